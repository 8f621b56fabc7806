// kvferry bench transport: scattered block reads from a second process, per backend, with
// same-run baselines. kvferry bench peer: that second process (also used by the tests).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/digest.h"
#include "common/pattern.h"
#include "common/subprocess.h"
#include "device/device.h"
#include "kvferry/host_memory.h"
#include "kvferry/transport.h"
#include "tools/commands.h"
#include "transport/shm/huge_pages.h"
#include "transport/ucx/ucx_section.h"

namespace kvferry::cli {
namespace {

constexpr std::uint64_t kPatternSeed = 0x6b76666572727900ull;  // "kvferry"

// Page-aligned memory, unmapped on destruction, faulted in at once: anonymous, or with `served`
// a kvferry::HostMemory (a memfd that same-host shm readers map). With `huge`, as transparent huge
// pages where the kernel has them (advised before the first touch, as an allocator with THP does;
// shmem_enabled decides for a memfd), else as 4 KiB pages.
class Buffer {
 public:
  Buffer(std::uint64_t bytes, bool huge, bool served = false) : bytes_(bytes) {
    if (served) {
      Result<HostMemory> m = HostMemory::Allocate(bytes, huge);
      if (!m.ok()) return;
      served_ = std::move(*m);
      data_ = served_.data();
      std::memset(data_, 0, bytes);  // faulted in now, not while measured
      return;
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (huge ? 0 : MAP_POPULATE), -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
    if (huge && data_ != nullptr) {
      // Best effort: without THP the pages are 4 KiB ones, as without --huge-pages.
      (void)madvise(data_, bytes, MADV_HUGEPAGE);
      std::memset(data_, 0, bytes);
    }
  }
  ~Buffer() {
    if (data_ != nullptr && served_.data() == nullptr) munmap(data_, bytes_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::byte* data() const { return data_; }
  std::uint64_t size() const { return bytes_; }

 private:
  std::uint64_t bytes_;
  std::byte* data_ = nullptr;
  HostMemory served_;  // with `served`
};

// `bytes` of host memory ("host") or of a device of this process ("sim:0", "cuda:0"), which the
// benchmark registers, reads into and checks.
class BenchMemory {
 public:
  static Result<std::unique_ptr<BenchMemory>> Create(const std::string& kind, std::uint64_t bytes,
                                                     bool huge_pages, bool served = false) {
    auto m = std::unique_ptr<BenchMemory>(new BenchMemory(bytes));
    if (kind == "host") {
      m->host_ = std::make_unique<Buffer>(bytes, huge_pages, served);
      if (m->host_->data() == nullptr) {
        return Status::ResourceExhausted("cannot allocate " + std::to_string(bytes) + " bytes");
      }
      return m;
    }
    KVFERRY_ASSIGN_OR_RETURN(m->kind_, ParseMemoryKind(kind));
    KVFERRY_ASSIGN_OR_RETURN(m->dev_, device::ProcessDevice(kind));
    KVFERRY_ASSIGN_OR_RETURN(m->alloc_, m->dev_->Allocate(bytes));
    KVFERRY_ASSIGN_OR_RETURN(m->stream_, m->dev_->CreateStream());
    return m;
  }
  const MemoryKind& kind() const { return kind_; }
  std::uint64_t size() const { return bytes_; }
  // What to register and read into: a host pointer, or a device address carried as one.
  std::byte* base() const {
    return host_ ? host_->data()
                 : reinterpret_cast<std::byte*>(
                       alloc_->address());  // NOLINT(performance-no-int-to-ptr)
  }
  // Fills it with the bench pattern, region by region (region r of `per` bytes has id r).
  Status FillPattern(std::uint64_t seed, std::uint64_t per) {
    std::vector<std::byte> chunk(std::min<std::uint64_t>(per, 8u << 20));
    for (std::uint64_t off = 0; off < bytes_;) {
      const std::uint64_t region = off / per;
      const std::uint64_t in = off % per;
      const std::uint64_t len = std::min<std::uint64_t>(chunk.size(), per - in);
      std::byte* dst = host_ ? host_->data() + off : chunk.data();
      ::kvferry::FillPattern(dst, len, seed, static_cast<std::uint32_t>(region), in);
      if (!host_) KVFERRY_RETURN_IF_ERROR(Copy(chunk.data(), off, len, /*upload=*/true));
      off += len;
    }
    return Status::Ok();
  }
  // Bytes [offset, offset + len), copied back from the device if need be.
  Result<std::vector<std::byte>> Read(std::uint64_t offset, std::uint64_t len) {
    std::vector<std::byte> out(len);
    if (host_) {
      std::memcpy(out.data(), host_->data() + offset, len);
    } else {
      KVFERRY_RETURN_IF_ERROR(Copy(out.data(), offset, len, /*upload=*/false));
    }
    return out;
  }

 private:
  explicit BenchMemory(std::uint64_t bytes) : bytes_(bytes) {}
  Status Copy(std::byte* host, std::uint64_t offset, std::uint64_t len, bool upload) {
    const device::DeviceAddress at = alloc_->address() + offset;
    KVFERRY_RETURN_IF_ERROR(upload ? stream_->CopyHostToDevice(at, host, len)
                                   : stream_->CopyDeviceToHost(host, at, len));
    KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::Event> e, stream_->RecordEvent());
    return e->Wait(DeadlineAfter(std::chrono::seconds(30)));
  }

  std::uint64_t bytes_;
  MemoryKind kind_;
  std::unique_ptr<Buffer> host_;
  device::Device* dev_ = nullptr;
  std::unique_ptr<device::DeviceAllocation> alloc_;
  std::unique_ptr<device::Stream> stream_;
};

// ---------------------------------------------------------------------------------------------
// bench peer

struct PeerArgs {
  std::string backend = "auto";
  std::uint64_t bytes = 64u << 20;
  int regions = 1;
  std::uint64_t seed = kPatternSeed;
  std::vector<std::string> transport_opts;
  std::string memory = "host";
  bool huge_pages = false;
  bool anonymous = false;  // host memory not from kvferry::HostMemory
};

int RunPeer(const PeerArgs& a) {
  Result<TransportOptionMap> opts = ParseTransportOpts(a.transport_opts, a.backend);
  if (!opts.ok() || a.regions < 1 || a.bytes % static_cast<std::uint64_t>(a.regions) != 0) {
    std::cerr << "kvferry bench peer: bad arguments"
              << (opts.ok() ? "" : ": " + opts.status().ToString()) << "\n";
    return 2;
  }
  TransportOptions options;
  options.backend = a.backend;
  options.backend_options = *opts;
  // Read once at startup, before any thread exists.
  const char* secret = std::getenv("KVFERRY_SECRET");  // NOLINT(concurrency-mt-unsafe)
  if (secret != nullptr) options.secret = secret;
  Result<std::unique_ptr<Transport>> t = CreateTransport(options);
  if (!t.ok()) {
    std::cerr << "kvferry bench peer: " << t.status().ToString() << "\n";
    return 1;
  }
  Result<std::unique_ptr<BenchMemory>> memory =
      BenchMemory::Create(a.memory, a.bytes, a.huge_pages, !a.anonymous);
  const std::uint64_t per = a.bytes / static_cast<std::uint64_t>(a.regions);
  Status filled = memory.ok() ? (*memory)->FillPattern(a.seed, per) : memory.status();
  if (!filled.ok()) {
    std::cerr << "kvferry bench peer: " << a.memory << " memory: " << filled.ToString() << "\n";
    return 1;
  }
  for (int r = 0; r < a.regions; ++r) {
    std::byte* base = (*memory)->base() + per * static_cast<std::uint64_t>(r);
    Status s = (*t)->RegisterMemory(static_cast<RegionId>(r), base, per, (*memory)->kind());
    if (!s.ok()) {
      std::cerr << "kvferry bench peer: " << s.ToString() << "\n";
      return 1;
    }
  }
  Result<std::vector<std::uint8_t>> d = (*t)->Descriptor();
  if (!d.ok()) return 1;
  std::cout << "READY " << ToHex(*d) << std::endl;
  // Serve until the parent closes our stdin.
  char c = 0;
  while (read(STDIN_FILENO, &c, 1) > 0) {
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// bench transport

struct BenchArgs {
  std::vector<std::string> backends = TransportBackendNames();
  std::vector<std::uint64_t> sizes = {4096, 65536, 1u << 20, 16u << 20};
  std::uint64_t pool_mib = 256;
  double min_seconds = 0.5;
  /// Alternating rounds: every backend and its baseline measured once per round, in turn.
  int rounds = 3;
  int inflight = 2;
  int connections = 4;
  std::vector<std::string> transport_opts;
  std::string memory = "host";  // host, sim or cuda: where both sides' blocks are
  /// Host pools (both sides' and the memcpy baseline's) as transparent huge pages.
  bool huge_pages = true;
  /// The serving peer's host pool: "host-memory" (kvferry::HostMemory) or "anonymous".
  std::string peer_memory = "host-memory";
  bool json = false;
};

// The backend options both sides of `a` use: --connections is the option tcp.connections by its
// own name, and a --transport-opt that sets it too comes later, so it decides.
std::vector<std::string> TransportOpts(const BenchArgs& a) {
  std::vector<std::string> opts = {"tcp.connections=" + std::to_string(a.connections)};
  opts.insert(opts.end(), a.transport_opts.begin(), a.transport_opts.end());
  return opts;
}

// The figures of one series (a backend's, or its baseline's) over the rounds.
struct Series {
  std::vector<double> gbps;
  double Median() const {
    std::vector<double> v = gbps;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
  }
  double Min() const { return gbps.empty() ? 0 : *std::min_element(gbps.begin(), gbps.end()); }
  double Max() const { return gbps.empty() ? 0 : *std::max_element(gbps.begin(), gbps.end()); }
};

struct Measurement {
  std::string backend;
  std::uint64_t block = 0;
  Series ours;
  std::string baseline;
  Series base;
  Series base_default;  // ucx: ucx_perftest at UCX's default settings
  // CPU seconds per GB moved: kvferry's reader (this process) and server (the peer process);
  // the baseline's, both its sides in this process (memcpy: the reader alone; tcp stream: both
  // threads), where it runs here (ucx_perftest runs in processes of its own: not measured).
  Series reader_cpu;
  Series server_cpu;
  Series base_cpu;
};

// Random scattered block pairs for one batch: remote blocks anywhere in a pool of
// `remote_blocks`, local blocks distinct among `local_blocks`.
std::vector<std::pair<std::uint64_t, std::uint64_t>> ScatterPlan(std::uint64_t remote_blocks,
                                                                 std::uint64_t local_blocks,
                                                                 std::uint64_t count,
                                                                 std::mt19937_64& rng) {
  std::vector<std::uint64_t> local(local_blocks);
  std::iota(local.begin(), local.end(), 0);
  std::shuffle(local.begin(), local.end(), rng);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> plan;
  count = std::min(count, local_blocks);
  for (std::uint64_t i = 0; i < count; ++i) plan.emplace_back(rng() % remote_blocks, local[i]);
  return plan;
}

// CPU seconds (user + system) a process has used: this one's (every thread's, getrusage), or
// another's from /proc/PID/stat (0 where it cannot be read).
double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

double CpuSeconds(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // Fields after the command (which may hold spaces, inside parentheses): utime is the 14th
  // field, stime the 15th, in clock ticks.
  const std::size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream in(text.substr(close + 2));
  std::vector<std::string> fields;
  for (std::string f; in >> f;) fields.push_back(f);
  if (fields.size() < 13) return 0;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  return (std::stod(fields[11]) + std::stod(fields[12])) / ticks;
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// memcpy of the same scattered gather inside one process: what shm is compared against.
double MemcpyGather(const Buffer& src, const Buffer& dst, std::uint64_t block, double min_seconds,
                    std::uint64_t per_batch, std::mt19937_64& rng) {
  const std::uint64_t blocks = src.size() / block;
  std::uint64_t bytes = 0;
  const auto start = Clock::now();
  auto now = start;
  do {
    for (const auto& [r, l] : ScatterPlan(blocks, blocks, per_batch, rng)) {
      std::memcpy(dst.data() + l * block, src.data() + r * block, block);
    }
    bytes += per_batch * block;
    now = Clock::now();
  } while (Seconds(start, now) < min_seconds);
  return static_cast<double>(bytes) / Seconds(start, now) / 1e9;
}

// Device-to-device copies of the same scattered gather inside one process, on one stream with
// one event per batch: what shm's IPC path (device memory on both sides) is compared against.
Result<double> DeviceCopyGather(const std::string& memory, std::uint64_t pool, std::uint64_t block,
                                double min_seconds, std::uint64_t per_batch, std::mt19937_64& rng) {
  KVFERRY_ASSIGN_OR_RETURN(device::Device * dev, device::ProcessDevice(memory));
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::DeviceAllocation> src, dev->Allocate(pool));
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::DeviceAllocation> dst, dev->Allocate(pool));
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::Stream> stream, dev->CreateStream());
  // Touched once before timing: fresh device memory may fault its pages in on first use (the
  // sim's memfd does), which the pools the transport reads were spared by their filling.
  KVFERRY_RETURN_IF_ERROR(stream->CopyDeviceToDevice(dst->address(), src->address(), pool));
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::Event> warm, stream->RecordEvent());
  KVFERRY_RETURN_IF_ERROR(warm->Wait(DeadlineAfter(std::chrono::seconds(60))));
  const std::uint64_t blocks = pool / block;
  std::uint64_t bytes = 0;
  const auto start = Clock::now();
  auto now = start;
  do {
    for (const auto& [r, l] : ScatterPlan(blocks, blocks, per_batch, rng)) {
      KVFERRY_RETURN_IF_ERROR(stream->CopyDeviceToDevice(dst->address() + l * block,
                                                         src->address() + r * block, block));
    }
    KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::Event> e, stream->RecordEvent());
    KVFERRY_RETURN_IF_ERROR(e->Wait(DeadlineAfter(std::chrono::seconds(60))));
    bytes += per_batch * block;
    now = Clock::now();
  } while (Seconds(start, now) < min_seconds);
  return static_cast<double>(bytes) / Seconds(start, now) / 1e9;
}

// One plain TCP stream over loopback between two threads: what tcp is compared against.
double PlainTcpStream(double min_seconds) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      listen(listener, 1) != 0) {
    close(listener);
    return 0;
  }
  const std::size_t chunk = 4u << 20;
  std::uint64_t received = 0;
  double seconds = 0;
  std::thread receiver([&] {
    const int fd = accept(listener, nullptr, nullptr);
    std::vector<char> buf(chunk);
    const auto start = Clock::now();
    ssize_t n = 0;
    while ((n = recv(fd, buf.data(), buf.size(), 0)) > 0) received += static_cast<std::uint64_t>(n);
    seconds = Seconds(start, Clock::now());
    close(fd);
  });
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    shutdown(listener, SHUT_RDWR);  // wakes the receiver's accept
  }
  std::vector<char> buf(chunk, 'x');
  const auto start = Clock::now();
  while (Seconds(start, Clock::now()) < min_seconds) {
    for (std::size_t off = 0; off < chunk;) {
      const ssize_t n = send(fd, buf.data() + off, chunk - off, MSG_NOSIGNAL);
      if (n <= 0) break;
      off += static_cast<std::size_t>(n);
    }
  }
  close(fd);
  receiver.join();
  close(listener);
  return seconds > 0 ? static_cast<double>(received) / seconds / 1e9 : 0;
}

// The environment that gives ucx_perftest the TCP segment sizes kvferry's UCX context uses
// (docs/transport.md, "ucx"): kvferry's default on both sides where this process's environment
// sets neither, nothing where it sets one (the child inherits it, as kvferry's context reads it).
std::string KvferryUcxSegments() {
  if (std::getenv("UCX_TCP_TX_SEG_SIZE") != nullptr ||  // NOLINT(concurrency-mt-unsafe)
      std::getenv("UCX_TCP_RX_SEG_SIZE") != nullptr) {  // NOLINT(concurrency-mt-unsafe)
    return "";
  }
  const std::string bytes = std::to_string(kUcxDefaultTcpSegBytes);
  return "UCX_TCP_TX_SEG_SIZE=" + bytes + " UCX_TCP_RX_SEG_SIZE=" + bytes + " ";
}

// Raw UCX: ucx_perftest's ucp_get of `block` bytes with 16 outstanding, server and client on
// loopback, under this process's UCX environment (UCX_TLS) and `env` (KEY=VALUE pairs, each
// followed by a space): what the ucx backend is compared against, with kvferry's segment sizes
// (like for like) and with UCX's defaults. NotFound when ucx_perftest is not installed (Debian's
// ucx-utils).
Result<double> UcxPerftestGet(std::uint64_t block, double min_seconds, const std::string& env) {
  if (std::system("command -v ucx_perftest >/dev/null 2>&1") !=
      0) {  // NOLINT(concurrency-mt-unsafe)
    return Status::NotFound("ucx_perftest is not installed (Debian's ucx-utils)");
  }
  const int port = 13300 + static_cast<int>(getpid() % 500);
  KVFERRY_ASSIGN_OR_RETURN(
      Subprocess server,
      Subprocess::Spawn({"/bin/sh", "-c", env + "exec ucx_perftest -p " + std::to_string(port)}));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its listener's start
  // About min_seconds of gets at the ~1 GB/s UCX's tcp transport reaches.
  const std::uint64_t iters =
      std::max<std::uint64_t>(1000, static_cast<std::uint64_t>(min_seconds * 1e9) / block);
  KVFERRY_ASSIGN_OR_RETURN(
      Subprocess client,
      Subprocess::Spawn({"/bin/sh", "-c",
                         env + "ucx_perftest 127.0.0.1 -p " + std::to_string(port) +
                             " -t ucp_get -s " + std::to_string(block) + " -O 16 -n " +
                             std::to_string(iters) + " 2>&1 | grep '^Final:'"}));
  Result<std::string> line = client.ReadLine(std::chrono::seconds(120));
  (void)client.CloseAndWait(std::chrono::seconds(5));
  (void)server.CloseAndWait(std::chrono::seconds(5));
  if (!line.ok()) return line.status().WithContext("ucx_perftest");
  // Final: iterations, latency 50 %, average, overall, bandwidth average, overall (MiB/s), ...
  std::istringstream in(line->substr(line->find(':') + 1));
  std::vector<double> fields;
  for (double v = 0; in >> v;) fields.push_back(v);
  if (fields.size() < 6) return Status::Internal("ucx_perftest printed '" + *line + "'");
  return fields[5] * 1048576.0 / 1e9;
}

// One backend's side of the benchmark: a peer process serving `pool` bytes of patterned memory
// of `memory`, this process's transport connected to it, and a local pool of the same kind.
class BackendBench {
 public:
  static Result<std::unique_ptr<BackendBench>> Start(const BenchArgs& a, const std::string& backend,
                                                     const std::string& memory) {
    auto b = std::unique_ptr<BackendBench>(new BackendBench(a, backend, memory));
    std::vector<std::string> argv = {
        SelfExe(),  "bench", "peer", "--backend", backend, "--bytes", std::to_string(b->pool_),
        "--memory", memory};
    if (a.huge_pages) argv.push_back("--huge-pages");
    if (a.peer_memory == "anonymous") argv.push_back("--anonymous");
    const std::vector<std::string> opts = TransportOpts(a);
    for (const std::string& arg : TransportOptArgv(opts)) argv.push_back(arg);
    KVFERRY_ASSIGN_OR_RETURN(Subprocess peer, Subprocess::Spawn(argv));
    b->peer_.emplace(std::move(peer));
    KVFERRY_ASSIGN_OR_RETURN(std::string line, b->peer_->ReadLine(std::chrono::seconds(60)));
    if (line.rfind("READY ", 0) != 0) return Status::Internal("unexpected peer output: " + line);
    KVFERRY_ASSIGN_OR_RETURN(const std::vector<std::uint8_t> descriptor, FromHex(line.substr(6)));
    TransportOptions options;
    options.backend = backend;
    KVFERRY_ASSIGN_OR_RETURN(options.backend_options, ParseTransportOpts(opts, backend));
    options.serve = false;
    KVFERRY_ASSIGN_OR_RETURN(b->t_, CreateTransport(options));
    KVFERRY_ASSIGN_OR_RETURN(b->local_, BenchMemory::Create(memory, b->pool_, a.huge_pages));
    // The local pool's pages faulted in before timing, as the peer's were by their filling.
    KVFERRY_RETURN_IF_ERROR(b->local_->FillPattern(kPatternSeed + 1, b->pool_));
    KVFERRY_RETURN_IF_ERROR(
        b->t_->RegisterMemory(0, b->local_->base(), b->pool_, b->local_->kind()));
    KVFERRY_ASSIGN_OR_RETURN(b->peer_id_,
                             b->t_->Connect(descriptor, DeadlineAfter(std::chrono::seconds(10))));
    return b;
  }
  ~BackendBench() {
    if (t_ && peer_id_ != 0) t_->Disconnect(peer_id_);
    t_.reset();
    if (peer_) (void)peer_->CloseAndWait(std::chrono::seconds(10));
  }
  BackendBench(const BackendBench&) = delete;
  BackendBench& operator=(const BackendBench&) = delete;

  // GB/s of `min_seconds` of scattered reads of `block`-byte blocks: batches of about 64 MiB, as
  // one request's blocks would be, `inflight` of them outstanding, each into its own share of the
  // local pool, from anywhere in the peer's. The first batch of each size is checked byte for byte.
  Result<double> Measure(std::uint64_t block) {
    const std::uint64_t blocks = pool_ / block;
    const std::uint64_t per_batch = std::clamp<std::uint64_t>((64u << 20) / block, 1, blocks);
    const auto slots = static_cast<std::uint64_t>(std::max(a_.inflight, 1));
    const std::uint64_t share = std::max<std::uint64_t>(blocks / slots, 1);
    struct InFlight {
      BatchId id;
      std::vector<std::pair<std::uint64_t, std::uint64_t>> plan;
    };
    std::deque<InFlight> inflight;
    std::uint64_t bytes = 0;
    std::uint64_t submitted = 0;
    auto finish_oldest = [&]() -> Status {
      InFlight f = std::move(inflight.front());
      inflight.pop_front();
      BatchResult res = t_->Wait(f.id, DeadlineAfter(std::chrono::seconds(61)));
      t_->Release(f.id);
      if (res.state != BatchState::kDone) return res.status;
      if (verified_.insert(block).second) {
        for (const auto& [r, l] : f.plan) {
          KVFERRY_ASSIGN_OR_RETURN(std::vector<std::byte> got, local_->Read(l * block, block));
          if (FirstPatternMismatch(got.data(), block, kPatternSeed, 0, r * block) >= 0) {
            return Status::Internal("benchmark read returned wrong bytes");
          }
        }
      }
      bytes += f.plan.size() * block;
      return Status::Ok();
    };
    const double reader_cpu = CpuSeconds();
    const double server_cpu = CpuSeconds(peer_->pid());
    const auto start = Clock::now();
    auto now = start;
    do {
      auto plan = ScatterPlan(blocks, share, per_batch, rng_);
      const std::uint64_t base_block = (submitted++ % slots) * share;
      std::vector<ReadOp> ops;
      ops.reserve(plan.size());
      for (auto& pr : plan) {
        pr.second += base_block;
        ops.push_back({local_->base() + pr.second * block, 0, pr.first * block, block});
      }
      KVFERRY_ASSIGN_OR_RETURN(BatchId b, t_->SubmitReads(peer_id_, std::move(ops),
                                                          DeadlineAfter(std::chrono::seconds(60))));
      inflight.push_back({b, std::move(plan)});
      if (inflight.size() >= slots) KVFERRY_RETURN_IF_ERROR(finish_oldest());
      now = Clock::now();
    } while (Seconds(start, now) < a_.min_seconds);
    while (!inflight.empty()) KVFERRY_RETURN_IF_ERROR(finish_oldest());
    const double gb = static_cast<double>(bytes) / 1e9;
    reader_cpu_per_gb_ = (CpuSeconds() - reader_cpu) / gb;
    server_cpu_per_gb_ = (CpuSeconds(peer_->pid()) - server_cpu) / gb;
    return gb / Seconds(start, Clock::now());
  }
  /// CPU seconds (user + system) per GB the last Measure used in this process (the reader's,
  /// every thread) and in the serving peer process.
  double reader_cpu_per_gb() const { return reader_cpu_per_gb_; }
  double server_cpu_per_gb() const { return server_cpu_per_gb_; }

  // The baseline of this backend and memory, measured now: the name, and GB/s.
  Result<std::pair<std::string, double>> Baseline(std::uint64_t block) {
    const std::uint64_t blocks = pool_ / block;
    const std::uint64_t per_batch = std::clamp<std::uint64_t>((64u << 20) / block, 1, blocks);
    if (backend_ == "shm" && memory_ != "host") {
      KVFERRY_ASSIGN_OR_RETURN(
          double g, DeviceCopyGather(memory_, pool_, block, a_.min_seconds, per_batch, rng_));
      return std::make_pair(std::string("device_copy_gather"), g);
    }
    if (backend_ == "shm") {
      if (!source_) {
        source_ = std::make_unique<Buffer>(pool_, a_.huge_pages);
        dest_ = std::make_unique<Buffer>(pool_, a_.huge_pages);
        if (source_->data() == nullptr || dest_->data() == nullptr) {
          return Status::ResourceExhausted("cannot allocate the benchmark buffers");
        }
        FillPattern(source_->data(), pool_, kPatternSeed, 0, 0);
      }
      return std::make_pair(std::string("memcpy_gather"),
                            MemcpyGather(*source_, *dest_, block, a_.min_seconds, per_batch, rng_));
    }
    if (backend_ == "ucx") {
      // Like for like: the TCP segments kvferry's context uses (UCX's default is 8 KiB).
      KVFERRY_ASSIGN_OR_RETURN(double g,
                               UcxPerftestGet(block, a_.min_seconds, KvferryUcxSegments()));
      return std::make_pair(std::string("ucx_perftest_get"), g);
    }
    return std::make_pair(std::string("tcp_stream"), PlainTcpStream(a_.min_seconds));
  }

  /// ucx only: the same baseline at UCX's default settings (no segment sizes of kvferry's), kept
  /// beside the like-for-like one; NotFound for other backends.
  Result<double> DefaultSettingsBaseline(std::uint64_t block) {
    if (backend_ != "ucx") return Status::NotFound("no default-settings baseline");
    return UcxPerftestGet(block, a_.min_seconds, "");
  }

  /// The local pool when it is host memory, else null; its size.
  const std::byte* host_memory() const {
    return local_->kind().is_host() ? local_->base() : nullptr;
  }
  std::uint64_t pool_bytes() const { return pool_; }

 private:
  BackendBench(const BenchArgs& a, std::string backend, std::string memory)
      : a_(a), backend_(std::move(backend)), memory_(std::move(memory)), pool_(a.pool_mib << 20) {}

  const BenchArgs& a_;
  const std::string backend_;
  const std::string memory_;
  const std::uint64_t pool_;
  std::optional<Subprocess> peer_;
  std::unique_ptr<Transport> t_;
  std::unique_ptr<BenchMemory> local_;
  PeerId peer_id_ = 0;
  std::mt19937_64 rng_{42};
  std::set<std::uint64_t> verified_;
  std::unique_ptr<Buffer> source_;  // the memcpy baseline's (host memory, shm)
  std::unique_ptr<Buffer> dest_;
  double reader_cpu_per_gb_ = 0;
  double server_cpu_per_gb_ = 0;
};

std::string SizeName(std::uint64_t b) {
  if (b >= (1u << 20) && b % (1u << 20) == 0) return std::to_string(b >> 20) + " MiB";
  if (b >= 1024 && b % 1024 == 0) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

// What a run measures: a backend over a memory, against a baseline of its own (memcpy gather,
// a tcp stream, raw UCX, device copies) or, for device memory over tcp, against host memory
// over tcp measured in the same rounds.
struct Target {
  std::string backend;
  std::string memory;
  int against = -1;  // index of the target whose own figures are this one's baseline, or -1
};

int RunBench(const BenchArgs& a) {
  std::vector<Target> targets;
  if (a.memory != "host") {
    if (a.memory != "sim" && a.memory != "cuda") {
      std::cerr << "kvferry bench transport: --memory expects host, sim or cuda; found " << a.memory
                << "\n";
      return 2;
    }
    // Device memory on both sides over tcp (staged through pinned buffers at both ends), against
    // host-memory tcp in the same rounds; then over shm (IPC, device to device), against device
    // copies inside one process.
    targets = {{"tcp", "host", -1}, {"tcp", a.memory + ":0", 0}, {"shm", a.memory + ":0", -1}};
  } else {
    for (const std::string& b : a.backends) targets.push_back({b, "host", -1});
  }
  std::vector<std::unique_ptr<BackendBench>> benches;
  for (const Target& t : targets) {
    Result<std::unique_ptr<BackendBench>> b = BackendBench::Start(a, t.backend, t.memory);
    if (!b.ok()) {
      std::cerr << "kvferry bench transport (" << t.backend << ", " << t.memory
                << "): " << b.status().ToString() << "\n";
      return 1;
    }
    benches.push_back(std::move(b).value());
  }
  // How much of a local host pool the kernel really gave huge pages (--huge-pages asks; THP may be
  // off or short of memory): the fraction of the first host pool, -1 when there is none.
  double huge_fraction = -1;
  for (const auto& b : benches) {
    if (b->host_memory() == nullptr) continue;
    huge_fraction = static_cast<double>(HugePageBytes(b->host_memory(), b->pool_bytes())) /
                    static_cast<double>(b->pool_bytes());
    break;
  }
  // results[target][size]; the rounds alternate every target and its baseline, so that a burst
  // of noise on this shared machine lands on all of them and the medians are comparable.
  std::vector<std::vector<Measurement>> results(targets.size());
  for (std::size_t i = 0; i < targets.size(); ++i) {
    for (std::uint64_t block : a.sizes) {
      Measurement m;
      m.backend = targets[i].backend + (targets[i].memory == "host" ? "" : "@" + targets[i].memory);
      m.block = block;
      results[i].push_back(std::move(m));
    }
  }
  for (int round = 0; round < std::max(a.rounds, 1); ++round) {
    for (std::size_t i = 0; i < targets.size(); ++i) {
      for (std::size_t k = 0; k < a.sizes.size(); ++k) {
        const std::uint64_t block = a.sizes[k];
        if ((a.pool_mib << 20) / block == 0) continue;
        Result<double> ours = benches[i]->Measure(block);
        if (!ours.ok()) {
          std::cerr << "kvferry bench transport (" << targets[i].backend
                    << "): " << ours.status().ToString() << "\n";
          return 1;
        }
        Measurement& m = results[i][k];
        m.ours.gbps.push_back(*ours);
        m.reader_cpu.gbps.push_back(benches[i]->reader_cpu_per_gb());
        m.server_cpu.gbps.push_back(benches[i]->server_cpu_per_gb());
        if (targets[i].against >= 0) {
          m.baseline = "tcp_host_memory";
          continue;  // filled below from the other target's figures of this round
        }
        const double cpu_before = CpuSeconds();
        const auto base_start = Clock::now();
        Result<std::pair<std::string, double>> base = benches[i]->Baseline(block);
        if (base.ok() && base->second > 0 && base->first != "ucx_perftest_get") {
          // GB the baseline moved: its rate over the time it ran (a few ms of setup included).
          const double gb = base->second * Seconds(base_start, Clock::now());
          m.base_cpu.gbps.push_back((CpuSeconds() - cpu_before) / gb);
        }
        if (Result<double> d = benches[i]->DefaultSettingsBaseline(block); d.ok()) {
          m.base_default.gbps.push_back(*d);
        }
        if (base.ok()) {
          m.baseline = base->first;
          m.base.gbps.push_back(base->second);
        } else if (m.baseline.empty()) {
          m.baseline = "none (" + std::string(base.status().message()) + ")";
        }
      }
    }
    for (std::size_t i = 0; i < targets.size(); ++i) {
      if (targets[i].against < 0) continue;
      for (std::size_t k = 0; k < a.sizes.size(); ++k) {
        const Series& other = results[static_cast<std::size_t>(targets[i].against)][k].ours;
        if (!other.gbps.empty()) results[i][k].base.gbps.push_back(other.gbps.back());
      }
    }
  }
  benches.clear();
  char line[512];
  if (a.json) {
    std::cout << "{\"rounds\": " << std::max(a.rounds, 1)
              << ", \"huge_pages\": " << (a.huge_pages ? "true" : "false")
              << ", \"peer_memory\": \"" << a.peer_memory << "\""
              << ", \"huge_page_fraction\": " << huge_fraction << ", \"results\": [";
    bool first = true;
    for (const auto& per_target : results) {
      for (const Measurement& m : per_target) {
        if (m.ours.gbps.empty()) continue;
        std::snprintf(line, sizeof(line),
                      "%s{\"backend\": \"%s\", \"block_bytes\": %llu, \"gbps\": %.3f, "
                      "\"gbps_min\": %.3f, \"gbps_max\": %.3f, \"baseline\": \"%s\", "
                      "\"baseline_gbps\": %.3f, \"baseline_min\": %.3f, \"baseline_max\": %.3f, "
                      "\"baseline_default_gbps\": %.3f, \"ratio\": %.3f, "
                      "\"reader_cpu_s_per_gb\": %.3f, \"server_cpu_s_per_gb\": %.3f, "
                      "\"baseline_cpu_s_per_gb\": %.3f}",
                      first ? "" : ", ", m.backend.c_str(),
                      static_cast<unsigned long long>(m.block), m.ours.Median(), m.ours.Min(),
                      m.ours.Max(), m.baseline.c_str(), m.base.Median(), m.base.Min(), m.base.Max(),
                      m.base_default.Median(),
                      m.base.Median() > 0 ? m.ours.Median() / m.base.Median() : 0.0,
                      m.reader_cpu.Median(), m.server_cpu.Median(), m.base_cpu.Median());
        std::cout << line;
        first = false;
      }
    }
    std::cout << "]}\n";
    return 0;
  }
  std::cout << "medians of " << std::max(a.rounds, 1)
            << " alternating rounds (min-max); ratio of the medians; host pools "
            << (a.huge_pages ? "advised to huge pages" : "in 4 KiB pages") << ", the peer's "
            << (a.peer_memory == "anonymous" ? "anonymous" : "from kvferry::HostMemory");
  if (huge_fraction >= 0) std::cout << " (" << std::lround(huge_fraction * 100) << " % huge)";
  std::cout << "\n"
            << "backend   block      GB/s (min-max)         baseline           GB/s (min-max)    "
               "     ratio   CPU s/GB: reader  server  baseline\n";
  for (const auto& per_target : results) {
    for (const Measurement& m : per_target) {
      if (m.ours.gbps.empty()) continue;
      std::snprintf(
          line, sizeof(line),
          "%-9s %-9s %6.2f (%5.2f-%5.2f)  %-18s %6.2f (%5.2f-%5.2f)  %5.2f  %15.3f "
          "%7.3f %9s\n",
          m.backend.c_str(), SizeName(m.block).c_str(), m.ours.Median(), m.ours.Min(), m.ours.Max(),
          m.baseline.c_str(), m.base.Median(), m.base.Min(), m.base.Max(),
          m.base.Median() > 0 ? m.ours.Median() / m.base.Median() : 0.0, m.reader_cpu.Median(),
          m.server_cpu.Median(),
          m.base_cpu.gbps.empty() ? "-" : std::to_string(m.base_cpu.Median()).substr(0, 5).c_str());
      std::cout << line;
      if (!m.base_default.gbps.empty()) {
        std::snprintf(line, sizeof(line), "%-9s %-9s %-22s  %-18s %6.2f (UCX's default settings)\n",
                      "", "", "", "  same, 8 KiB segs", m.base_default.Median());
        std::cout << line;
      }
    }
  }
  return 0;
}

}  // namespace

void AddBenchCommands(CLI::App& app, int& exit_code) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  AddBenchControlCommand(*bench, exit_code);

  auto targs = std::make_shared<BenchArgs>();
  CLI::App* transport = bench->add_subcommand(
      "transport", "Scattered block reads from a second process, per backend, against baselines");
  transport->add_option("--backends", targs->backends, "Backends to measure")->delimiter(',');
  transport->add_option("--sizes", targs->sizes, "Block sizes in bytes")->delimiter(',');
  transport->add_option("--pool-mib", targs->pool_mib, "Memory the peer exposes, MiB")
      ->capture_default_str();
  transport->add_option("--min-seconds", targs->min_seconds, "Time per measurement")
      ->capture_default_str();
  transport
      ->add_option("--rounds,--repeat", targs->rounds,
                   "Alternating rounds (every backend and its baseline once per round); medians "
                   "and min-max reported")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  transport->add_option("--inflight", targs->inflight, "Batches kept outstanding")
      ->capture_default_str();
  AddTransportOptOption(*transport, targs->transport_opts);
  transport
      ->add_option("--connections", targs->connections,
                   "tcp connections per peer: the option tcp.connections (a --transport-opt "
                   "that sets it decides)")
      ->capture_default_str();
  transport
      ->add_option("--memory", targs->memory,
                   "host, or sim/cuda: device memory on both sides over tcp (staged), "
                   "against host-memory tcp in the same run")
      ->capture_default_str();
  transport
      ->add_option("--huge-pages", targs->huge_pages,
                   "Host pools (both sides' and the memcpy baseline's) as transparent huge pages, "
                   "as an allocator with THP gives them (false: 4 KiB pages; docs/performance.md)")
      ->capture_default_str();
  transport
      ->add_option("--peer-memory", targs->peer_memory,
                   "host-memory: the serving process allocates its pool with kvferry::HostMemory, "
                   "which a same-host shm reader maps and copies with memcpy; anonymous: plain "
                   "anonymous memory, which shm reads with process_vm_readv (docs/performance.md)")
      ->check(CLI::IsMember({"host-memory", "anonymous"}))
      ->capture_default_str();
  transport->add_flag("--json", targs->json, "Machine-readable output");
  transport->callback([targs, &exit_code] { exit_code = RunBench(*targs); });

  auto pargs = std::make_shared<PeerArgs>();
  CLI::App* peer = bench->add_subcommand(
      "peer", "Serve patterned memory to a benchmark or test until stdin closes (internal)");
  peer->add_option("--backend", pargs->backend, TransportChoices());
  AddTransportOptOption(*peer, pargs->transport_opts);
  peer->add_option("--bytes", pargs->bytes, "Bytes to register");
  peer->add_option("--regions", pargs->regions, "Split into this many regions (ids 0..n-1)");
  peer->add_option("--seed", pargs->seed, "Pattern seed");
  peer->add_option("--memory", pargs->memory, "host, or a device of this process (sim:0, cuda:0)");
  peer->add_flag("--huge-pages", pargs->huge_pages,
                 "Host memory as transparent huge pages (advised before its first touch)");
  peer->add_flag("--anonymous", pargs->anonymous,
                 "Host memory as anonymous memory, not kvferry::HostMemory (shm then reads it "
                 "with process_vm_readv)");
  peer->callback([pargs, &exit_code] { exit_code = RunPeer(*pargs); });
}

}  // namespace kvferry::cli
