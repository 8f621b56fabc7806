// libFuzzer target: the tcp read-request parsers (header, then ops) must turn any bytes into a
// frame or an error, and a parsed frame must re-encode to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "transport/tcp/frames.h"

using namespace kvferry::tcp;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < kRequestHeaderBytes) return 0;
  auto h = ParseRequestHeader(
      std::span<const std::uint8_t, kRequestHeaderBytes>(data, kRequestHeaderBytes));
  if (!h.ok()) return 0;
  std::uint8_t again[kOpBytes];
  for (std::size_t i = 0; i < h->op_count; ++i) {
    const std::size_t at = kRequestHeaderBytes + i * kOpBytes;
    if (at + kOpBytes > size) break;
    auto op = ParseOp(std::span<const std::uint8_t, kOpBytes>(data + at, kOpBytes));
    if (!op.ok()) return 0;
    EncodeOp(*op, again);
    if (std::memcmp(again, data + at, kOpBytes) != 0) std::abort();
  }
  if (size >= kResponseHeaderBytes) {
    (void)ParseResponseHeader(
        std::span<const std::uint8_t, kResponseHeaderBytes>(data, kResponseHeaderBytes));
  }
  return 0;
}
