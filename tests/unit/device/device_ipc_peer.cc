// The second process of the device IPC tests, and the probe of make test-gpu / make test-npu.
//
//   device_ipc_peer probe [device]
//     opens <device> (default cuda:0; npu:0 for the NPU check); exits 0 if it opens, else prints
//     "no CUDA driver/device: <why>" (cuda) or "no NPU runtime/device: <why>" (npu) and exits 77.
//   device_ipc_peer import <device> <hex IpcHandle> <seed> <write_seed>
//     imports the handle on <device> (e.g. sim:0, cuda:0, npu:0), checks that the bytes from the
//     handle's offset to the end of the allocation hold the pattern of <seed> (region 0, pattern
//     offset = handle offset), overwrites them with the pattern of <write_seed>, waits for the
//     copy, prints "ok" and waits for stdin to close. Any failure prints "error <status>" and
//     exits 1.
#include <cstdio>
#include <iostream>
#include <string>

#include "device/device.h"
#include "tests/unit/device/device_test_util.h"

namespace {

using namespace kvferry;          // NOLINT(google-build-using-namespace): a test program
using namespace kvferry::device;  // NOLINT(google-build-using-namespace)

int Fail(const Status& s) {
  std::cout << "error " << s.ToString() << std::endl;
  return 1;
}

int Import(const std::string& device_name, const std::string& hex, std::uint64_t seed,
           std::uint64_t write_seed) {
  auto device = OpenDevice(device_name);
  if (!device.ok()) return Fail(device.status());
  const auto bytes = testing::FromHex(hex);
  auto handle = IpcHandle::Decode(bytes);
  if (!handle.ok()) return Fail(handle.status());
  auto imported = (*device)->ImportIpc(*handle);
  if (!imported.ok()) return Fail(imported.status());
  auto stream = (*device)->CreateStream();
  if (!stream.ok()) return Fail(stream.status());
  const std::uint64_t offset = handle->offset;
  const std::uint64_t length = handle->alloc_size - offset;
  const DeviceAddress at = (*imported)->address(offset);
  auto got = testing::Download(**stream, at, length);
  if (!got.ok()) return Fail(got.status());
  const std::int64_t bad = FirstPatternMismatch(got->data(), length, seed, 0, offset);
  if (bad >= 0) {
    return Fail(Status::Internal("imported bytes differ from the exporter's at offset " +
                                 std::to_string(offset + static_cast<std::uint64_t>(bad))));
  }
  if (Status s = testing::Upload(**stream, at, testing::PatternBytes(length, write_seed, offset));
      !s.ok()) {
    return Fail(s);
  }
  std::cout << "ok" << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "probe" && (argc == 2 || argc == 3)) {
    const std::string name = argc == 3 ? argv[2] : "cuda:0";
    auto device = OpenDevice(name);
    if (!device.ok()) {
      std::cout << (name.rfind("npu", 0) == 0 ? "no NPU runtime/device: "
                                              : "no CUDA driver/device: ")
                << device.status().ToString() << std::endl;
      return 77;
    }
    std::cout << "found " << (*device)->name() << std::endl;
    return 0;
  }
  if (mode == "import" && argc == 6) {
    return Import(argv[2], argv[3], std::stoull(argv[4]), std::stoull(argv[5]));
  }
  std::cerr << "usage: device_ipc_peer probe [device] | import <device> <hex handle> <seed> "
               "<write_seed>\n";
  return 2;
}
