// A shared library with one small thread_local block, loaded with dlopen by dtls_exit.cc. Its
// 48 bytes are what makes the dynamic TLS block land where GCC 12's LeakSanitizer misreads it
// (see dtls_exit.cc); do not change the size without checking that test still fails without the
// fix.
#include <cstring>

namespace {
thread_local char block[48];
}  // namespace

extern "C" __attribute__((visibility("default"))) char* kvferry_dtls_touch() {
  std::memset(block, 1, sizeof(block));
  return block;
}
