// The transfer part of the device checks (scripts/npu_check.sh; docs/device.md): a second process
// serves device memory filled with a pattern, and this one reads all of it into its own device
// memory, as scattered 64 KiB blocks, once over shm (same-host IPC: device to device) and once over
// tcp (staged through pinned host memory at both ends), checks every byte after each read, and
// prints each read's rate against a copy within one device in this process.
//
//   device_transfer_check --device <name> [--mib N] [--no-ipc-ok]
//     <name>: npu:0, cuda:0, sim:0. Exit 0: every byte of both reads checked; 77: the device does
//     not open here (nothing was tested); 1: a failure. --no-ipc-ok: a peer whose memory cannot be
//     read over IPC (an old runtime) is reported, not a failure.
//   device_transfer_check serve <name> <bytes> <seed>
//     the serving process: prints "READY <hex descriptor>" and serves until stdin closes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/pattern.h"
#include "common/subprocess.h"
#include "device/device.h"
#include "kvferry/transport.h"
#include "tests/unit/device/device_test_util.h"

namespace {

using namespace kvferry;  // NOLINT(google-build-using-namespace): a test program
using Seconds = std::chrono::duration<double>;

constexpr std::uint64_t kChunk = 8u << 20;   // host <-> device staging of this program
constexpr std::uint64_t kBlock = 64u << 10;  // one read
constexpr RegionId kRegion = 0;
constexpr RegionId kLocalRegion = 1;

int Fail(const std::string& what, const Status& s) {
  std::cout << "device_transfer_check: FAILED: " << what << ": " << s.ToString() << std::endl;
  return 1;
}

// Writes the pattern of `seed` (or zeros) over [at, at + bytes) of the device, in chunks.
Status Fill(device::Device& dev, device::Stream& stream, device::DeviceAddress at,
            std::uint64_t bytes, std::uint64_t seed, bool zeros) {
  KVFERRY_ASSIGN_OR_RETURN(auto buffer, dev.AllocatePinned(kChunk));
  for (std::uint64_t done = 0; done < bytes; done += kChunk) {
    const std::uint64_t n = std::min(kChunk, bytes - done);
    if (zeros) {
      std::fill(buffer->data(), buffer->data() + n, std::byte{0});
    } else {
      FillPattern(buffer->data(), n, seed, kRegion, done);
    }
    KVFERRY_RETURN_IF_ERROR(stream.CopyHostToDevice(at + done, buffer->data(), n));
    KVFERRY_RETURN_IF_ERROR(device::testing::Sync(stream));
  }
  return Status::Ok();
}

// Checks every byte of [at, at + bytes) against the pattern of `seed`.
Status Verify(device::Device& dev, device::Stream& stream, device::DeviceAddress at,
              std::uint64_t bytes, std::uint64_t seed) {
  KVFERRY_ASSIGN_OR_RETURN(auto buffer, dev.AllocatePinned(kChunk));
  for (std::uint64_t done = 0; done < bytes; done += kChunk) {
    const std::uint64_t n = std::min(kChunk, bytes - done);
    KVFERRY_RETURN_IF_ERROR(stream.CopyDeviceToHost(buffer->data(), at + done, n));
    KVFERRY_RETURN_IF_ERROR(device::testing::Sync(stream));
    if (const std::int64_t bad = FirstPatternMismatch(buffer->data(), n, seed, kRegion, done);
        bad >= 0) {
      return Status::Internal("byte " + std::to_string(done + static_cast<std::uint64_t>(bad)) +
                              " differs from the serving process's");
    }
  }
  return Status::Ok();
}

int Serve(const std::string& name, std::uint64_t bytes, std::uint64_t seed) {
  auto dev = device::ProcessDevice(name);
  if (!dev.ok()) return Fail("serve: opening " + name, dev.status());
  auto alloc = (*dev)->Allocate(bytes);
  auto stream = (*dev)->CreateStream();
  if (!alloc.ok() || !stream.ok()) return Fail("serve: allocating", alloc.status());
  if (Status s = Fill(**dev, **stream, (*alloc)->address(), bytes, seed, false); !s.ok()) {
    return Fail("serve: filling", s);
  }
  TransportOptions o;
  o.backend = "shm,tcp";
  auto transport = CreateTransport(o);
  if (!transport.ok()) return Fail("serve: transport", transport.status());
  auto* addr = reinterpret_cast<void*>((*alloc)->address());  // NOLINT(performance-no-int-to-ptr)
  const auto kind = ParseMemoryKind(name);
  if (Status s = (*transport)->RegisterMemory(kRegion, addr, bytes, *kind); !s.ok()) {
    return Fail("serve: registering", s);
  }
  auto d = (*transport)->Descriptor();
  if (!d.ok()) return Fail("serve: descriptor", d.status());
  std::cout << "READY " << device::testing::ToHex(*d) << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  return 0;
}

struct Reading {
  bool done = false;
  double gbps = 0;
  std::string note;
};

// Reads the peer's whole region into `local` over `backend` as shuffled 64 KiB blocks, then
// checks every byte.
Reading ReadAll(const std::string& backend, const std::vector<std::uint8_t>& descriptor,
                device::Device& dev, device::Stream& stream, device::DeviceAddress local,
                std::uint64_t bytes, std::uint64_t seed, int* failures) {
  Reading out;
  const auto fail = [&](const std::string& what, const Status& s) {
    Fail(backend + ": " + what, s);
    ++*failures;
    return out;
  };
  if (Status s = Fill(dev, stream, local, bytes, 0, true); !s.ok()) return fail("zeroing", s);
  TransportOptions o;
  o.backend = backend;
  o.serve = false;
  auto t = CreateTransport(o);
  if (!t.ok()) return fail("transport", t.status());
  auto* base = reinterpret_cast<std::byte*>(local);  // NOLINT(performance-no-int-to-ptr)
  if (Status s = (*t)->RegisterMemory(kLocalRegion, base, bytes, *ParseMemoryKind(dev.name()));
      !s.ok()) {
    return fail("registering", s);
  }
  auto peer = (*t)->Connect(descriptor, DeadlineAfter(std::chrono::seconds(30)));
  if (!peer.ok()) {
    out.note = peer.status().ToString();
    return out;  // the caller decides whether that is a failure
  }
  std::vector<std::uint64_t> order(bytes / kBlock);
  for (std::uint64_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937_64(17));
  std::vector<ReadOp> reads;
  for (std::uint64_t i = 0; i < order.size(); ++i) {
    reads.push_back({base + order[i] * kBlock, kRegion, order[i] * kBlock, kBlock});
  }
  const auto start = Clock::now();
  auto batch = (*t)->SubmitReads(*peer, reads, DeadlineAfter(std::chrono::seconds(120)));
  if (!batch.ok()) return fail("submitting", batch.status());
  const BatchResult r = (*t)->Wait(*batch, DeadlineAfter(std::chrono::seconds(130)));
  const double seconds = Seconds(Clock::now() - start).count();
  (*t)->Release(*batch);
  if (r.state != BatchState::kDone) return fail("reading", r.status);
  if (Status s = Verify(dev, stream, local, bytes, seed); !s.ok()) return fail("checking", s);
  out.done = true;
  out.gbps = static_cast<double>(bytes) / seconds / 1e9;
  return out;  // the transport (and its imports) closes here, before the peer is told to exit
}

int Check(const std::string& name, std::uint64_t mib, bool no_ipc_ok) {
  auto dev = device::ProcessDevice(name);
  if (!dev.ok()) {
    std::cout << "device_transfer_check: " << name
              << " does not open here, nothing was tested: " << dev.status().ToString()
              << std::endl;
    return 77;
  }
  const std::uint64_t bytes = mib << 20;
  const std::uint64_t seed = 0x6b76746300ull + mib;
  auto a = (*dev)->Allocate(bytes);
  auto b = (*dev)->Allocate(bytes);
  auto stream = (*dev)->CreateStream();
  if (!a.ok() || !b.ok() || !stream.ok()) return Fail("allocating", a.status());
  if (Status s = Fill(**dev, **stream, (*a)->address(), bytes, seed, false); !s.ok()) {
    return Fail("filling", s);
  }
  // The yardstick: one copy of the whole region within the device, best of three.
  double copy_s = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    if (Status s = (*stream)->CopyDeviceToDevice((*b)->address(), (*a)->address(), bytes);
        !s.ok()) {
      return Fail("device copy", s);
    }
    if (Status s = device::testing::Sync(**stream); !s.ok()) return Fail("device copy", s);
    copy_s = std::min(copy_s, Seconds(Clock::now() - start).count());
  }
  if (Status s = Verify(**dev, **stream, (*b)->address(), bytes, seed); !s.ok()) {
    return Fail("device copy", s);
  }
  const double copy_gbps = static_cast<double>(bytes) / copy_s / 1e9;
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  auto peer = Subprocess::Spawn({self, "serve", name, std::to_string(bytes), std::to_string(seed)});
  if (!peer.ok()) return Fail("starting the serving process", peer.status());
  auto line = peer->ReadLine(std::chrono::seconds(120));
  if (!line.ok() || line->rfind("READY ", 0) != 0) {
    return Fail("the serving process did not start",
                line.ok() ? Status::Internal(*line) : line.status());
  }
  const std::vector<std::uint8_t> descriptor = device::testing::FromHex(line->substr(6));
  int failures = 0;
  const Reading ipc =
      ReadAll("shm", descriptor, **dev, **stream, (*b)->address(), bytes, seed, &failures);
  if (!ipc.done && !ipc.note.empty()) {
    std::cout << "device_transfer_check: same-host IPC read NOT possible: " << ipc.note
              << std::endl;
    if (!no_ipc_ok) ++failures;
  }
  const Reading tcp =
      ReadAll("tcp", descriptor, **dev, **stream, (*b)->address(), bytes, seed, &failures);
  if (!tcp.done && !tcp.note.empty()) {
    std::cout << "device_transfer_check: tcp connect failed: " << tcp.note << std::endl;
    ++failures;
  }
  (void)peer->CloseAndWait(std::chrono::seconds(30));
  std::printf("device_transfer_check %s, %llu MiB as 64 KiB blocks, every byte checked:\n",
              name.c_str(), static_cast<unsigned long long>(mib));
  std::printf("  %-28s %8.2f GB/s  (1.00)\n", "in-process device copy", copy_gbps);
  for (const auto& [label, r] : {std::pair{"shm, IPC (device to device)", ipc},
                                 std::pair{"tcp, staged at both ends", tcp}}) {
    if (r.done) {
      std::printf("  %-28s %8.2f GB/s  (%.2f)\n", label, r.gbps, r.gbps / copy_gbps);
    } else {
      std::printf("  %-28s not measured\n", label);
    }
  }
  std::fflush(stdout);
  if (failures != 0) {
    std::cout << "device_transfer_check: FAILED (" << failures << ")" << std::endl;
    return 1;
  }
  std::cout << "device_transfer_check: passed" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 4 && args[0] == "serve") {
    return Serve(args[1], std::stoull(args[2]), std::stoull(args[3]));
  }
  std::string name;
  std::uint64_t mib = 256;
  bool no_ipc_ok = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--device" && i + 1 < args.size()) {
      name = args[++i];
    } else if (args[i] == "--mib" && i + 1 < args.size()) {
      mib = std::stoull(args[++i]);
    } else if (args[i] == "--no-ipc-ok") {
      no_ipc_ok = true;
    } else {
      name.clear();
      break;
    }
  }
  if (name.empty() || mib == 0) {
    std::cerr << "usage: device_transfer_check --device <npu:0|cuda:0|sim:0> [--mib N] "
                 "[--no-ipc-ok]\n";
    return 2;
  }
  return Check(name, mib, no_ipc_ok);
}
