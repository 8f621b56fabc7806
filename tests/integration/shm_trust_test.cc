// shm trust across processes (issue 11): a same-host reader proves that the process at the
// descriptor's pid wrote the descriptor before it reads a byte, and a kernel that refuses the
// read sends `auto` to tcp with a text that says how to enable shm.
//
// Peers are `kvferry bench peer` processes (patterned memory, as in transport_test.cc), or, where
// the reader must not be the server's ancestor, a forked child of this test that reads this
// process.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <iostream>
#include <string>

#include "common/clock.h"
#include "common/digest.h"
#include "common/pattern.h"
#include "common/subprocess.h"
#include "kvferry/transport.h"
#include "tests/bench_peer.h"
#include "transport/descriptor.h"
#include "transport/shm/shm_section.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr std::uint64_t kSeed = 0x6b76666572727900ull;  // the peer's default pattern seed
constexpr std::uint64_t kPeerBytes = 1u << 20;

using Peer = testing::BenchPeer;

Peer StartPeer(const std::string& backend) {
  return testing::StartBenchPeer(
      {"--backend", backend, "--bytes", std::to_string(kPeerBytes), "--regions", "1"});
}

std::unique_ptr<Transport> MakeReader(const std::string& backend) {
  TransportOptions o;
  o.backend = backend;
  o.serve = false;
  Result<std::unique_ptr<Transport>> t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

// A peer's descriptor with its shm section decoded, to tamper with.
struct Decoded {
  PeerDescriptor descriptor;
  ShmSection shm;

  std::vector<std::uint8_t> Encode() const {
    PeerDescriptor d = descriptor;
    d.sections["shm"] = EncodeShmSection(shm);
    return EncodeDescriptor(d);
  }
};

Decoded Decode(const std::vector<std::uint8_t>& bytes) {
  Result<PeerDescriptor> d = DecodeDescriptor(bytes);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  Result<ShmSection> shm = DecodeShmSection(d->Section("shm"));
  EXPECT_TRUE(shm.ok()) << "the peer's shm section: " << shm.status().ToString();
  return Decoded{*d, shm.ok() ? *shm : ShmSection{}};
}

// Reads the first 64 KiB of the peer's region 0 into registered local memory and checks them.
void ExpectReadsThePattern(Transport& reader, PeerId peer) {
  std::vector<std::byte> local(64u << 10);
  ASSERT_TRUE(reader.RegisterMemory(100, local.data(), local.size()).ok());
  Result<BatchId> b = reader.SubmitReads(peer, {{local.data(), 0, 0, local.size()}},
                                         DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const BatchResult r = reader.Wait(*b, DeadlineAfter(milliseconds(10000)));
  EXPECT_EQ(r.state, BatchState::kDone) << r.status.ToString();
  EXPECT_EQ(FirstPatternMismatch(local.data(), local.size(), kSeed, 0, 0), -1);
  reader.Release(*b);
  EXPECT_TRUE(reader.DeregisterMemory(100).ok());
}

TEST(ShmTrustTest, TheRealDescriptorIsProvenAndRead) {
  Peer peer = StartPeer("shm");
  std::unique_ptr<Transport> reader = MakeReader("shm");
  Result<PeerId> p = reader->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ExpectReadsThePattern(*reader, *p);
}

// The old peer's descriptor reaching another live process at its pid (a restarted instance that
// got the same pid, simulated by naming the other process's pid): nothing of it is read. Before
// the fix Connect succeeded and reads returned the other process's bytes.
TEST(ShmTrustTest, AnotherProcessAtTheDescriptorsPidIsNotRead) {
  Peer old_peer = StartPeer("shm");
  Peer other = StartPeer("shm");
  Decoded d = Decode(old_peer.descriptor);
  d.shm.host.pid = other.process->pid();
  std::unique_ptr<Transport> reader = MakeReader("shm");
  Result<PeerId> p = reader->Connect(d.Encode(), DeadlineAfter(milliseconds(5000)));
  ASSERT_FALSE(p.ok()) << "the process at pid " << d.shm.host.pid << " was accepted as the peer";
  EXPECT_EQ(p.status().code(), StatusCode::kUnavailable);
  // Started in another clock tick, or (when both started in the same tick) a different nonce.
  EXPECT_THAT(p.status().message(),
              AnyOf(HasSubstr("started at tick"), HasSubstr("instance nonce")));
}

// Tampering with one field of a real descriptor: the process is the right one, but the proof
// does not match, so nothing is read.
TEST(ShmTrustTest, AWrongNonceOrStartTimeFailsConnect) {
  Peer peer = StartPeer("shm");
  std::unique_ptr<Transport> reader = MakeReader("shm");
  Decoded d = Decode(peer.descriptor);
  d.shm.proof.nonce += 1;
  Result<PeerId> nonce = reader->Connect(d.Encode(), DeadlineAfter(milliseconds(5000)));
  ASSERT_FALSE(nonce.ok());
  EXPECT_EQ(nonce.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(nonce.status().message(), HasSubstr("instance nonce"));
  d = Decode(peer.descriptor);
  d.shm.proof.start_time += 1;
  Result<PeerId> start = reader->Connect(d.Encode(), DeadlineAfter(milliseconds(5000)));
  ASSERT_FALSE(start.ok());
  EXPECT_THAT(start.status().message(), HasSubstr("started at tick"));
  // The untampered descriptor still connects: the failures above were the proof's.
  EXPECT_TRUE(reader->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000))).ok());
}

// shm's check fails (the nonce cannot be read): `auto` reads over tcp instead, correctly. Before
// the fix `auto` chose shm without reading any nonce.
TEST(ShmTrustTest, AutoFallsBackToTcpWhenTheProofCannotBeRead) {
  Peer peer = StartPeer("auto");
  Decoded d = Decode(peer.descriptor);
  ASSERT_FALSE(d.descriptor.Section("tcp").empty());
  d.shm.proof.nonce_addr = 8;  // page zero is never mapped
  std::unique_ptr<Transport> reader = MakeReader("auto");
  Result<PeerId> p = reader->Connect(d.Encode(), DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  Result<std::string> backend = reader->PeerBackend(*p);
  ASSERT_TRUE(backend.ok());
  EXPECT_EQ(*backend, "tcp");
  ExpectReadsThePattern(*reader, *p);
}

// --- A reader that is not the server's ancestor: a forked child of this test reads this process.

// What the child reads first, to learn whether the kernel refuses it.
std::uint64_t g_probe_word = 0x70726f6265;  // NOLINT: read by a forked child through the kernel

int YamaScope() {
  std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
  int scope = -1;
  return (f >> scope) ? scope : -1;
}

// Drops CAP_SYS_PTRACE from this process's capability sets (a no-op where it has none).
bool DropPtraceCapability() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  const auto index = CAP_TO_INDEX(CAP_SYS_PTRACE);
  const auto mask = CAP_TO_MASK(CAP_SYS_PTRACE);
  data[index].effective &= ~mask;
  data[index].permitted &= ~mask;
  data[index].inheritable &= ~mask;
  return syscall(SYS_capset, &header, data) == 0;
}

// Reads everything from `fd` until EOF or the deadline.
std::string ReadAll(int fd, Deadline deadline) {
  std::string out;
  char buf[4096];
  while (!Expired(deadline)) {
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (poll(&p, 1, static_cast<int>(std::max<std::int64_t>(left.count(), 1))) <= 0) continue;
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

struct ChildOutcome {
  bool refused = false;  // the kernel refused the child's plain read of this process
  std::string result;    // "backend=<name>" or "error=<status>"
};

// The child, forked while this process has one thread: waits for the descriptor, drops
// CAP_SYS_PTRACE, probes a plain read of its parent, connects with `kind` and reports.
[[noreturn]] void ChildReader(int in, int out, const std::string& backend) {
  const std::string hex = ReadAll(in, DeadlineAfter(milliseconds(20000)));
  std::string report;
  if (!DropPtraceCapability()) report += "nocapset ";
  std::uint64_t word = 0;
  iovec local{&word, sizeof(word)};
  iovec remote{&g_probe_word, sizeof(word)};
  const bool refused = process_vm_readv(getppid(), &local, 1, &remote, 1, 0) < 0 && errno == EPERM;
  report += refused ? "refused\n" : "allowed\n";
  Result<std::vector<std::uint8_t>> descriptor = FromHex(hex);
  TransportOptions o;
  o.backend = backend;
  o.serve = false;
  Result<std::unique_ptr<Transport>> t = CreateTransport(o);
  if (!descriptor.ok() || !t.ok()) {
    report += "error=setup: " + descriptor.status().ToString() + " " + t.status().ToString();
  } else {
    Result<PeerId> p = (*t)->Connect(*descriptor, DeadlineAfter(milliseconds(5000)));
    report +=
        p.ok() ? "backend=" + (*t)->PeerBackend(*p).value() : "error=" + p.status().ToString();
  }
  (void)!write(out, report.data(), report.size());
  _exit(0);
}

// Serves this process's memory (with the option as given) and lets a forked child read it.
ChildOutcome ReadThisProcessFromAChild(const std::string& backend, bool permit_any_tracer) {
  int to_child[2];
  int from_child[2];
  EXPECT_EQ(pipe(to_child), 0);
  EXPECT_EQ(pipe(from_child), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(to_child[1]);
    close(from_child[0]);
    ChildReader(to_child[0], from_child[1], backend);
  }
  close(to_child[0]);
  close(from_child[1]);
  ChildOutcome outcome;
  {
    TransportOptions o;  // serving: tcp server on loopback, shm section in the descriptor
    if (permit_any_tracer) o.backend_options["shm.permit_any_tracer"] = "true";
    Result<std::unique_ptr<Transport>> server = CreateTransport(o);
    EXPECT_TRUE(server.ok()) << server.status().ToString();
    std::vector<std::byte> memory(1u << 16, std::byte{0x33});
    EXPECT_TRUE((*server)->RegisterMemory(0, memory.data(), memory.size()).ok());
    const std::string hex = ToHex((*server)->Descriptor().value());
    EXPECT_EQ(write(to_child[1], hex.data(), hex.size()), static_cast<ssize_t>(hex.size()));
    close(to_child[1]);
    const std::string report = ReadAll(from_child[0], DeadlineAfter(milliseconds(30000)));
    close(from_child[0]);
    const std::size_t line = report.find('\n');
    outcome.refused = report.rfind("refused", line) != std::string::npos;
    outcome.result = line == std::string::npos ? report : report.substr(line + 1);
    if (report.empty()) kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << report;
  }
  return outcome;
}

// The kernel refuses the reader (here because it lacks a capability this process has; under
// Yama ptrace_scope=1 because it is a sibling): `auto` reads over tcp, forced shm fails, and the
// text says how to enable shm. Before the fix the text named neither the option nor the sysctl.
TEST(ShmTrustTest, AKernelRefusalSendsAutoToTcpAndSaysHowToEnableShm) {
  const ChildOutcome automatic = ReadThisProcessFromAChild("auto", false);
  if (!automatic.refused) {
    GTEST_SKIP() << "CANNOT BE EXERCISED HERE: the kernel lets a child without CAP_SYS_PTRACE read "
                    "this process (euid "
                 << geteuid() << ", yama ptrace_scope " << YamaScope()
                 << "; needs root, or Yama ptrace_scope=1)";
  }
  EXPECT_EQ(automatic.result, "backend=tcp");
  const ChildOutcome forced = ReadThisProcessFromAChild("shm", false);
  ASSERT_TRUE(forced.refused);
  EXPECT_THAT(forced.result, HasSubstr("error="));
  EXPECT_THAT(forced.result, HasSubstr("EPERM"));
  EXPECT_THAT(forced.result, HasSubstr("shm.permit_any_tracer=true"));
  EXPECT_THAT(forced.result, HasSubstr("sysctl kernel.yama.ptrace_scope=0"));
}

// Under Yama ptrace_scope=1 a sibling reader needs the serving side's explicit option. This host
// may have no Yama (or run as root, whose capabilities Yama honours): then it says so and skips;
// the decision itself is tested in tests/unit/transport/shm_backend_test.cc.
TEST(ShmTrustTest, UnderYamaASiblingReadsOverShmOnlyWithTheOption) {
  const int scope = YamaScope();
  if (scope != 1) {
    GTEST_SKIP() << "CANNOT BE EXERCISED HERE: kernel.yama.ptrace_scope is "
                 << (scope < 0 ? std::string("absent (no Yama)") : std::to_string(scope))
                 << "; the option's effect needs ptrace_scope=1";
  }
  const ChildOutcome off = ReadThisProcessFromAChild("auto", false);
  ASSERT_TRUE(off.refused) << "ptrace_scope=1 but a child read its parent";
  EXPECT_EQ(off.result, "backend=tcp");
  // Sets PR_SET_PTRACER_ANY on this test process for the rest of its life: run last in its file.
  const ChildOutcome on = ReadThisProcessFromAChild("auto", true);
  if (on.refused) {
    GTEST_SKIP() << "CANNOT BE EXERCISED HERE: with PR_SET_PTRACER_ANY the child is still "
                    "refused, for a reason other than Yama (euid "
                 << geteuid() << ": this process's capabilities exceed the child's)";
  }
  EXPECT_EQ(on.result, "backend=shm");
}

}  // namespace
}  // namespace kvferry
