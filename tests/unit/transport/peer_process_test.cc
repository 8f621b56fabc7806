// The peer-process proof (docs/transport.md, "The peer-process proof"): every backend that proves a
// same-host peer by its pid (shm and ucx) follows one rule, so the same descriptor fault gets the
// same answer from each. The peer here is this process, described by the backend's own section
// with its pid or start time replaced.
#include "transport/peer_process.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "transport/backend.h"
#include "transport/shm/shm_section.h"
#include "transport/ucx/ucx_section.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

// Sets the soft limit on open files to 0 while it lives, so that no new file descriptor (a pidfd
// among them) can be opened; existing ones keep working.
class NoNewFileDescriptors {
 public:
  NoNewFileDescriptors() {
    getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit none = saved_;
    none.rlim_cur = 0;
    ok_ = setrlimit(RLIMIT_NOFILE, &none) == 0;
  }
  ~NoNewFileDescriptors() { setrlimit(RLIMIT_NOFILE, &saved_); }
  NoNewFileDescriptors(const NoNewFileDescriptors&) = delete;
  NoNewFileDescriptors& operator=(const NoNewFileDescriptors&) = delete;
  bool ok() const { return ok_; }

 private:
  rlimit saved_{};
  bool ok_ = false;
};

// The pid of a process that existed and has exited (and was reaped).
pid_t ExitedPid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

class PeerProofTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(registry_.Add(1, memory_.data(), memory_.size()).ok());
    TransportOptions o;
    o.backend = GetParam();
    const TransportOptionMap own;
    Result<std::unique_ptr<Backend>> b =
        FindBackend(GetParam())->create(BackendContext{o, own, &registry_});
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    backend_ = std::move(b).value();
    section_ = backend_->DescriptorSection();
    ASSERT_FALSE(section_.empty());
    regions_ = {
        {1, reinterpret_cast<std::uint64_t>(memory_.data()), memory_.size(), MemoryKind::Host()}};
  }
  void TearDown() override {
    for (auto& peer : connected_) peer->Shutdown();
    connected_.clear();
    backend_.reset();
  }

  // This process's own section, with the pid and the start time it names replaced.
  std::vector<std::uint8_t> Naming(std::int64_t pid, std::int64_t start_delta) const {
    if (GetParam() == "shm") {
      ShmSection s = DecodeShmSection(section_).value();
      s.host.pid = pid;
      s.proof.start_time += static_cast<std::uint64_t>(start_delta);
      return EncodeShmSection(s);
    }
    UcxSection s = DecodeUcxSection(section_).value();
    s.host.pid = pid;
    s.start_time += static_cast<std::uint64_t>(start_delta);
    return EncodeUcxSection(s);
  }

  Status Connect(const std::vector<std::uint8_t>& section) {
    Result<std::unique_ptr<BackendPeer>> peer =
        backend_->Connect(PeerView{regions_, section}, DeadlineAfter(milliseconds(5000)));
    if (!peer.ok()) return peer.status();
    connected_.push_back(std::move(peer).value());
    return Status::Ok();
  }

  std::vector<std::byte> memory_ = std::vector<std::byte>(4096, std::byte{0x5a});
  RegionRegistry registry_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::uint8_t> section_;
  std::vector<RemoteRegion> regions_;
  std::vector<std::unique_ptr<BackendPeer>> connected_;
};

TEST_P(PeerProofTest, TheWriterOfTheSectionIsProven) {
  const Status s = Connect(Naming(getpid(), 0));
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// shm said Unavailable ("does not exist") where ucx said PeerDisconnected: the process is gone.
TEST_P(PeerProofTest, AProcessThatExitedIsPeerDisconnected) {
  const Status s = Connect(Naming(ExitedPid(), 0));
  EXPECT_EQ(s.code(), StatusCode::kPeerDisconnected) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("does not exist"));
}

TEST_P(PeerProofTest, AnotherStartTimeIsPeerDisconnected) {
  const Status s = Connect(Naming(getpid(), 1));
  EXPECT_EQ(s.code(), StatusCode::kPeerDisconnected) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("started at tick"));
}

// The pidfd is required: ucx used to warn and connect without one (so a same-host peer was never
// proven and its death found only by UCX or the deadline) where shm refused.
TEST_P(PeerProofTest, WithoutAPidfdASameHostPeerIsUnavailable) {
  Status s;
  {
    NoNewFileDescriptors limit;
    ASSERT_TRUE(limit.ok());
    s = Connect(Naming(getpid(), 0));
  }
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("pidfd_open"));
}

TEST(PeerProcessTest, AnotherHostOrAPidOutOfRangeIsNeverProven) {
  const HostIdentity self = LocalHostIdentity().value();
  const std::uint64_t start = ProcessStartTime(getpid()).value();
  Result<PeerProcess> proven = PeerProcess::Prove(self, self, start);
  ASSERT_TRUE(proven.ok()) << proven.status().ToString();
  EXPECT_EQ(proven->pid(), getpid());
  EXPECT_TRUE(proven->Alive());
  HostIdentity other = self;
  other.boot_id = "another-boot";
  EXPECT_EQ(PeerProcess::Prove(self, other, start).status().code(), StatusCode::kUnavailable);
  other = self;
  other.pid_namespace += 1;
  EXPECT_EQ(PeerProcess::Prove(self, other, start).status().code(), StatusCode::kUnavailable);
  for (const std::int64_t pid : {std::int64_t{0}, std::int64_t{-3}, std::int64_t{1} << 40}) {
    HostIdentity bad = self;
    bad.pid = pid;
    EXPECT_EQ(PeerProcess::Prove(self, bad, start).status().code(), StatusCode::kInvalidArgument)
        << pid;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, PeerProofTest, ::testing::Values("shm", "ucx"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kvferry
