// libFuzzer target: transport descriptors come from peers; decoding must never crash, and a
// decoded descriptor must round-trip.
#include <cstdint>
#include <cstdlib>
#include <span>

#include "transport/descriptor.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto d = kvferry::DecodeDescriptor(std::span<const std::uint8_t>(data, size));
  if (!d.ok()) return 0;
  auto again = kvferry::DecodeDescriptor(kvferry::EncodeDescriptor(*d));
  if (!again.ok() || !(*again == *d)) std::abort();
  return 0;
}
