// Runs a libFuzzer target without libFuzzer: every seed file given (files or directories), then
// deterministic variants of each (every truncation point, single-byte changes at every offset),
// so a gcc or sanitizer build replays the corpus as a regression test in CTest (label fuzz).
// A finding aborts, as under libFuzzer.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

std::size_t Run(const std::vector<std::uint8_t>& input) {
  LLVMFuzzerTestOneInput(input.data(), input.size());
  return 1;
}

std::size_t Variants(const std::vector<std::uint8_t>& seed) {
  std::size_t runs = Run(seed);
  for (std::size_t len = 0; len < seed.size(); ++len) {
    runs += Run(std::vector<std::uint8_t>(seed.begin(), seed.begin() + static_cast<long>(len)));
  }
  for (std::size_t i = 0; i < seed.size(); ++i) {
    for (std::uint8_t v : {std::uint8_t{0x00}, std::uint8_t{0xff}, std::uint8_t{0x7f},
                           static_cast<std::uint8_t>(seed[i] ^ 0x01)}) {
      std::vector<std::uint8_t> m = seed;
      m[i] = v;
      runs += Run(m);
    }
  }
  return runs;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t seeds = 0;
  std::size_t runs = 0;
  for (int a = 1; a < argc; ++a) {
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(argv[a])) {
      for (const auto& e : std::filesystem::directory_iterator(argv[a])) files.push_back(e.path());
    } else {
      files.emplace_back(argv[a]);
    }
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "cannot read seed %s\n", f.c_str());
        return 1;
      }
      const std::vector<std::uint8_t> seed((std::istreambuf_iterator<char>(in)),
                                           std::istreambuf_iterator<char>());
      runs += Variants(seed);
      ++seeds;
    }
  }
  if (seeds == 0) {
    std::fprintf(stderr, "no seeds given\n");
    return 1;
  }
  std::printf("%zu seeds, %zu inputs, no finding\n", seeds, runs);
  return 0;
}
