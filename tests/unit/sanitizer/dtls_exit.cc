// Regression test for the CI failure of 2026-11-30: connector_test_ucx passed every test and then
// died at exit with "Tracer caught signal 11" from LeakSanitizer.
//
// Cause, in the sanitizer runtime of GCC 12 (and of GCC up to 13, LLVM up to 16): its
// __tls_get_addr interceptor takes a dynamic TLS block whose address is 16 bytes past a page
// boundary for one carrying the header of glibc 2.19 and older, and reads the two words before it
// as that block's bounds. Since glibc 2.25 there is no such header; the leak checker's tracer
// then scans a garbage range and faults. A library loaded with dlopen that has thread_local data
// (UCX's libucs, which the ucx backend loads) gets such blocks, and where they land is chance.
// https://github.com/google/sanitizers/issues/1322
//
// This program makes the chance a certainty. glibc allocates a thread's block of a dlopen'ed
// library with malloc on first touch, and ASan hands out 48-byte allocations 64 bytes apart, so the
// program allocates until the next one would sit 16 bytes past a page boundary, then touches the
// 48-byte block of dtls_block. It checks that the block did land there (and fails, saying so, if
// the allocator placed it elsewhere: the test would prove nothing). It is run by make asan, whose
// ASAN_OPTIONS carry intercept_tls_get_addr=0 (the runtime then does not track dynamic TLS, and
// the tracer does not scan it); without that option it dies at exit as connector_test_ucx did.
// Built only in ASan builds.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr std::size_t kBlockBytes = 48;  // dtls_block.cc's thread_local block
constexpr std::uintptr_t kPage = 4096;
constexpr std::uintptr_t kMisreadOffset = 16;  // sizeof the glibc 2.19 header the runtime expects
constexpr std::uintptr_t kStride = 64;         // ASan's spacing of 48-byte allocations

// Kept reachable until exit, so the leak check does not report them.
std::vector<void*>* fillers = new std::vector<void*>();

std::uintptr_t PageOffset(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % kPage; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s PATH_TO_DTLS_BLOCK_LIBRARY\n", argv[0]);
    return 2;
  }
  void* library = dlopen(argv[1], RTLD_NOW);
  if (library == nullptr) {
    std::fprintf(stderr, "dlopen %s failed: %s\n", argv[1], dlerror());
    return 2;
  }
  using Touch = char* (*)();
  auto touch = reinterpret_cast<Touch>(dlsym(library, "kvferry_dtls_touch"));
  if (touch == nullptr) {
    std::fprintf(stderr, "%s has no kvferry_dtls_touch: %s\n", argv[1], dlerror());
    return 2;
  }
  fillers->reserve(1 << 16);
  for (int i = 0; i < (1 << 16); ++i) {
    void* p = std::malloc(kBlockBytes);
    fillers->push_back(p);
    if (PageOffset(p) == (kMisreadOffset + kPage - kStride) % kPage) break;
  }
  const char* block = touch();
  const auto offset = static_cast<std::uintmax_t>(PageOffset(block));
  std::printf("dynamic TLS block at page offset %ju\n", offset);
  if (offset != kMisreadOffset) {
    std::fprintf(stderr,
                 "expected the dynamic TLS block at page offset %ju, found %ju: the allocator "
                 "placed it elsewhere, so this run tests nothing; adjust the filler allocations\n",
                 static_cast<std::uintmax_t>(kMisreadOffset), offset);
    return 1;
  }
  // The library stays loaded: the leak check at exit runs with its block live, as UCX's is.
  return 0;
}
