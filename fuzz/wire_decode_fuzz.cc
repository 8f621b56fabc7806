// libFuzzer target: the side-channel decoder must turn any bytes into a message or an error.
// A decoded message must re-encode and decode to itself.
#include <cstdint>
#include <cstdlib>
#include <span>

#include "wire/messages.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvferry::Result<kvferry::wire::Message> m =
      kvferry::wire::Decode(std::span<const std::uint8_t>(data, size));
  if (!m.ok()) return 0;
  kvferry::Result<kvferry::wire::Message> again = kvferry::wire::Decode(kvferry::wire::Encode(*m));
  if (!again.ok() || !(*again == *m)) std::abort();
  return 0;
}
