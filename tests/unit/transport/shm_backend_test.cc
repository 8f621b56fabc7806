// The shm backend's proof of instance and the serving side's tracer decision, inside one process
// (a process may always read its own memory). Multi-process cases are in
// tests/integration/shm_trust_test.cc.
#include "transport/shm/shm_backend.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "common/clock.h"
#include "transport/transport_core.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

// Field 22 of /proc/self/stat, parsed here independently of the backend.
std::uint64_t SelfStartTime() {
  std::ifstream f("/proc/self/stat");
  std::stringstream text;
  text << f.rdbuf();
  const std::string s = text.str();
  std::istringstream rest(s.substr(s.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 22; ++i) rest >> field;
  return std::stoull(field);
}

// What a test peer publishes, before it is encoded into the shm section the backend reads.
struct ShmPeerDescription {
  HostIdentity host;
  std::optional<ShmProof> shm;
  std::vector<RemoteRegion> regions;
};

class ShmProofTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<HostIdentity> self = LocalHostIdentity();
    ASSERT_TRUE(self.ok()) << self.status().ToString();
    self_ = *self;
    Result<ShmProof> proof = ShmBackend::LocalProof();
    ASSERT_TRUE(proof.ok()) << proof.status().ToString();
    descriptor_.host = self_;
    descriptor_.shm = *proof;
    descriptor_.regions.push_back(
        {7, reinterpret_cast<std::uint64_t>(memory_.data()), memory_.size(), MemoryKind::Host()});
  }

  Result<std::unique_ptr<BackendPeer>> Connect(const ShmPeerDescription& d) {
    const std::vector<std::uint8_t> section =
        d.shm ? EncodeShmSection(ShmSection{d.host, *d.shm, {}, {}}) : std::vector<std::uint8_t>{};
    return backend_.Connect(PeerView{d.regions, section}, DeadlineAfter(milliseconds(2000)));
  }

  HostIdentity self_;
  std::vector<std::byte> memory_ = std::vector<std::byte>(4096, std::byte{0x5a});
  ShmPeerDescription descriptor_;
  ShmBackend backend_{LocalHostIdentity().value(), ShmBackend::LocalProof().value(), 1};
};

TEST_F(ShmProofTest, LocalProofNamesThisProcessAndStaysTheSame) {
  Result<ShmProof> again = ShmBackend::LocalProof();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *descriptor_.shm);
  EXPECT_EQ(descriptor_.shm->start_time, SelfStartTime());
  ASSERT_NE(descriptor_.shm->nonce_addr, 0u);
  // The nonce lives where the proof says: that is what peers read.
  EXPECT_EQ(*reinterpret_cast<const std::uint64_t*>(descriptor_.shm->nonce_addr),
            descriptor_.shm->nonce);
}

TEST_F(ShmProofTest, TheRightProofConnects) {
  Result<std::unique_ptr<BackendPeer>> peer = Connect(descriptor_);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  (*peer)->Shutdown();
}

// Issue 11: the pid was trusted without proof; a process that reused it was read as the peer.
TEST_F(ShmProofTest, AWrongNonceIsPeerDisconnected) {
  ShmPeerDescription d = descriptor_;
  d.shm->nonce ^= 1;
  Result<std::unique_ptr<BackendPeer>> peer = Connect(d);
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kPeerDisconnected) << peer.status().ToString();
  EXPECT_THAT(peer.status().message(), HasSubstr("instance nonce"));
}

TEST_F(ShmProofTest, AWrongStartTimeIsPeerDisconnected) {
  ShmPeerDescription d = descriptor_;
  d.shm->start_time += 1;
  Result<std::unique_ptr<BackendPeer>> peer = Connect(d);
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kPeerDisconnected) << peer.status().ToString();
  EXPECT_THAT(peer.status().message(), HasSubstr("started at tick"));
}

TEST_F(ShmProofTest, AnUnreadableNonceAddressIsPeerDisconnected) {
  ShmPeerDescription d = descriptor_;
  d.shm->nonce_addr = 8;  // page zero is never mapped
  Result<std::unique_ptr<BackendPeer>> peer = Connect(d);
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kPeerDisconnected) << peer.status().ToString();
  EXPECT_THAT(peer.status().message(), HasSubstr("no readable instance nonce"));
}

// The proof comes before the first read of a region: with a region that cannot be read at all,
// a wrong nonce is what Connect reports, and with the right nonce the region probe fails.
TEST_F(ShmProofTest, TheProofIsCheckedBeforeAnyRegionIsRead) {
  void* guard = mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(guard, MAP_FAILED);
  ShmPeerDescription d = descriptor_;
  d.regions = {{7, reinterpret_cast<std::uint64_t>(guard), 4096, MemoryKind::Host()}};
  Result<std::unique_ptr<BackendPeer>> right = Connect(d);
  ASSERT_FALSE(right.ok());
  EXPECT_EQ(right.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(right.status().message(), HasSubstr("region 7"));
  d.shm->nonce ^= 1;
  Result<std::unique_ptr<BackendPeer>> wrong = Connect(d);
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kPeerDisconnected);
  EXPECT_THAT(wrong.status().message(), HasSubstr("instance nonce"));
  munmap(guard, 4096);
}

TEST_F(ShmProofTest, ADescriptorWithoutShmSectionIsNotReadOverShm) {
  ShmPeerDescription d = descriptor_;
  d.shm.reset();
  Result<std::unique_ptr<BackendPeer>> peer = Connect(d);
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(peer.status().message(), HasSubstr("no shm section"));
}

// Issue 11: pid 0 reached pidfd_open; a descriptor built in-process never gets past Connect.
TEST_F(ShmProofTest, PidZeroIsRefusedByTheBackendToo) {
  ShmPeerDescription d = descriptor_;
  d.host.pid = 0;
  Result<std::unique_ptr<BackendPeer>> peer = Connect(d);
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kInvalidArgument) << peer.status().ToString();
}

TEST(ShmRefusalTest, TheRefusalSaysHowToEnableShm) {
  const std::string text = ShmBackend::RefusedReadText(1234);
  EXPECT_THAT(text, HasSubstr("EPERM"));
  EXPECT_THAT(text, HasSubstr("shm.permit_any_tracer=true"));
  EXPECT_THAT(text, HasSubstr("--shm-permit-any-tracer"));
  EXPECT_THAT(text, HasSubstr("sysctl kernel.yama.ptrace_scope=0"));
}

// Issue 11: every serving transport called PR_SET_PTRACER_ANY. Now only an explicit option does.
TEST(ShmTracerDecisionTest, OnlyTheExplicitOptionPermitsAnyTracer) {
  TransportOptions o;
  EXPECT_FALSE(ParseShmOptions(o, {})->permit_any_tracer);
  EXPECT_TRUE(o.serve);
  EXPECT_FALSE(ServingPermitsAnyTracer(o));  // the defaults: serving, auto, option off
  o.backend = "shm";
  EXPECT_FALSE(ServingPermitsAnyTracer(o));
  o.backend_options["shm.permit_any_tracer"] = "true";
  EXPECT_TRUE(ServingPermitsAnyTracer(o));
  o.backend = "auto";
  EXPECT_TRUE(ServingPermitsAnyTracer(o));
  o.backend = "tcp,shm";
  EXPECT_TRUE(ServingPermitsAnyTracer(o));
  o.backend = "tcp";
  EXPECT_FALSE(ServingPermitsAnyTracer(o));
  o.backend = "auto";
  o.serve = false;
  EXPECT_FALSE(ServingPermitsAnyTracer(o));
  o.serve = true;
  o.backend_options["shm.permit_any_tracer"] = "false";
  EXPECT_FALSE(ServingPermitsAnyTracer(o));
}

bool PermittedAnyTracer(const TransportCore& core) {
  const auto* shm = static_cast<const ShmBackend*>(core.FindBackendInstance("shm"));
  return shm != nullptr && shm->permitted_any_tracer();
}

TEST(ShmTracerDecisionTest, AServingTransportCallsPrctlOnlyWithTheOption) {
  TransportOptions o;  // serving, auto
  Result<std::unique_ptr<TransportCore>> plain = TransportCore::Create(o);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_FALSE(PermittedAnyTracer(**plain));
  o.backend_options["shm.permit_any_tracer"] = "true";
  Result<std::unique_ptr<TransportCore>> permitting = TransportCore::Create(o);
  ASSERT_TRUE(permitting.ok()) << permitting.status().ToString();
  EXPECT_TRUE(PermittedAnyTracer(**permitting));
  o.serve = false;
  Result<std::unique_ptr<TransportCore>> reading = TransportCore::Create(o);
  ASSERT_TRUE(reading.ok()) << reading.status().ToString();
  EXPECT_FALSE(PermittedAnyTracer(**reading));
}

TEST(ShmDescriptorTest, ATransportsDescriptorCarriesThisProcesssProof) {
  TransportOptions o;
  o.serve = false;
  Result<std::unique_ptr<TransportCore>> core = TransportCore::Create(o);
  ASSERT_TRUE(core.ok()) << core.status().ToString();
  Result<std::vector<std::uint8_t>> bytes = (*core)->Descriptor();
  ASSERT_TRUE(bytes.ok());
  Result<PeerDescriptor> d = DecodeDescriptor(*bytes);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  Result<ShmSection> shm = DecodeShmSection(d->Section("shm"));
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  EXPECT_EQ(shm->proof, ShmBackend::LocalProof().value());
  EXPECT_EQ(shm->host.pid, getpid());
  EXPECT_TRUE(d->Section("tcp").empty());  // not serving: no tcp section
}

}  // namespace
}  // namespace kvferry
