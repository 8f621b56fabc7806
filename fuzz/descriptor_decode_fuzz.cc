// libFuzzer target: transport descriptors come from peers; decoding must never crash, and a
// decoded descriptor must round-trip, as must each backend section its backend decodes.
#include <cstdint>
#include <cstdlib>
#include <span>

#include "transport/descriptor.h"
#include "transport/shm/shm_section.h"
#include "transport/tcp/tcp_section.h"
#include "transport/ucx/ucx_section.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> bytes(data, size);
  // Sections are fuzzed on their own too: the same bytes as a whole section of each backend.
  if (auto shm = kvferry::DecodeShmSection(bytes); shm.ok()) {
    auto again = kvferry::DecodeShmSection(kvferry::EncodeShmSection(*shm));
    if (!again.ok() || !(*again == *shm)) std::abort();
  }
  if (auto tcp = kvferry::DecodeTcpSection(bytes); tcp.ok()) {
    auto again = kvferry::DecodeTcpSection(kvferry::EncodeTcpSection(*tcp));
    if (!again.ok() || !(*again == *tcp)) std::abort();
  }
  if (auto ucx = kvferry::DecodeUcxSection(bytes); ucx.ok()) {
    auto again = kvferry::DecodeUcxSection(kvferry::EncodeUcxSection(*ucx));
    if (!again.ok() || !(*again == *ucx)) std::abort();
  }
  auto d = kvferry::DecodeDescriptor(bytes);
  if (!d.ok()) return 0;
  auto again = kvferry::DecodeDescriptor(kvferry::EncodeDescriptor(*d));
  if (!again.ok() || !(*again == *d)) std::abort();
  for (const auto& [name, section] : d->sections) {
    (void)kvferry::DecodeShmSection(section);
    (void)kvferry::DecodeTcpSection(section);
    (void)kvferry::DecodeUcxSection(section);
  }
  return 0;
}
