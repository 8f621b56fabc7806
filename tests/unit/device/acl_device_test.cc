// The acl device (src/device/acl/) where there is no NPU: loading it without CANN, and its own
// logic on a fake libascendcl (fake_libascendcl.cc, host memory): copies, Query, the page-aligned
// IPC export and the permit that puts the reader's pid on the exporter's whitelist, the order of
// closes, event states, the stream's drain, and a runtime older than CANN 8.2.RC1. The fake follows
// CANN's documentation as kvferry reads it; only scripts/npu_check.sh shows the real runtime
// agrees.
#include "device/acl/acl_device.h"

#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <unistd.h>

#include <sstream>
#include <thread>

#include "common/clock.h"
#include "common/log.h"
#include "device/acl/acl_ipc.h"
#include "device/acl/acl_permit.h"
#include "device/device.h"
#include "kvferry/transport.h"
#include "tests/unit/device/device_test_util.h"

namespace kvferry::device {
namespace {

using testing::Download;
using ::testing::HasSubstr;
using testing::PatternBytes;
using testing::Upload;

// The fake's controls, found in the copy of it the runtime loaded.
struct FakeControls {
  void* lib = nullptr;
  void (*set_event)(int, int) = nullptr;
  void (*set_sync_result)(int) = nullptr;
  void (*set_init_result)(int) = nullptr;
  int (*violations)() = nullptr;
  int (*live_streams)() = nullptr;
  int (*live_exports)() = nullptr;
  int (*live_imports)() = nullptr;
  int (*whitelist_size)(const char*) = nullptr;
  acl::PFN_aclrtMalloc malloc = nullptr;  // as torch_npu allocates, behind kvferry's back
  acl::PFN_aclrtFree free = nullptr;

  explicit FakeControls(const char* path) {
    lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) return;
    Find(set_event, "fake_acl_set_event");
    Find(set_sync_result, "fake_acl_set_sync_result");
    Find(set_init_result, "fake_acl_set_init_result");
    Find(violations, "fake_acl_violations");
    Find(live_streams, "fake_acl_live_streams");
    Find(live_exports, "fake_acl_live_exports");
    Find(live_imports, "fake_acl_live_imports");
    Find(whitelist_size, "fake_acl_whitelist_size");
    Find(malloc, "aclrtMalloc");
    Find(free, "aclrtFree");
  }
  ~FakeControls() {
    if (lib != nullptr) dlclose(lib);
  }
  template <typename F>
  void Find(F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(lib, name));
  }
  bool ok() const { return lib != nullptr && set_event != nullptr && free != nullptr; }
};

// Captures what the process logs while it lives.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    Log().sinks().push_back(sink_);
  }
  ~LogCapture() { Log().sinks().pop_back(); }
  std::string Text() {
    Log().flush();
    return out_.str();
  }
  std::size_t Count(const std::string& what) {
    const std::string text = Text();
    std::size_t n = 0;
    for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

// ---- Without CANN ----

TEST(AclLoaderTest, AMissingLibraryNamesItWhereItWasLookedForAndTheWayOut) {
  auto rt = AclRuntime::Load({"/nonexistent/libascendcl.so", "libascendcl-not-here.so"});
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), StatusCode::kUnavailable);
  const std::string m(rt.status().message());
  EXPECT_EQ(m.rfind("no NPU runtime", 0), 0u) << m;
  EXPECT_THAT(m, HasSubstr("libascendcl.so"));
  EXPECT_THAT(m, HasSubstr("/nonexistent/libascendcl.so"));
  EXPECT_THAT(m, HasSubstr("libascendcl-not-here.so"));
  EXPECT_THAT(m, HasSubstr("LD_LIBRARY_PATH"));
  EXPECT_THAT(m, HasSubstr("set_env.sh"));
  EXPECT_THAT(m, HasSubstr("kv_buffer_device \"cpu\""));
}

TEST(AclLoaderTest, ALibraryWithoutTheRuntimeApiIsUnavailable) {
  auto rt = AclRuntime::Load({"libc.so.6"});  // loads, but has no aclInit
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(std::string(rt.status().message()), HasSubstr("lacks aclInit"));
}

TEST(AclLoaderTest, DefaultLibrariesFollowTheEnvironment) {
  const auto libs = AclRuntime::DefaultLibraries();
  ASSERT_FALSE(libs.empty());
  if (std::getenv("KVFERRY_ACL_LIBRARY") != nullptr) {  // NOLINT(concurrency-mt-unsafe)
    EXPECT_EQ(libs.size(), 1u);
  } else {
    EXPECT_EQ(libs.front(), "libascendcl.so");
    EXPECT_EQ(libs.back(), "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so");
  }
}

// Through the public entry points: a machine without CANN gets "no NPU runtime ..." from
// OpenDevice, and a transport refuses to register NPU memory with the same reason.
TEST(AclLoaderTest, WithoutCannNpuMemoryIsRefusedAtRegistrationNamingTheLibrary) {
  EXPECT_TRUE(KnownDeviceType("npu"));
  auto dev = OpenDevice("npu:0");
  if (dev.ok()) GTEST_SKIP() << "this machine has " << (*dev)->name() << ": see make test-npu";
  EXPECT_EQ(dev.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(dev.status().message().rfind("no NPU", 0), 0u) << dev.status().ToString();
  TransportOptions o;
  o.backend = "tcp";
  o.serve = false;
  auto t = CreateTransport(o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  std::vector<std::byte> memory(4096);
  const Status s = (*t)->RegisterMemory(3, memory.data(), memory.size(), MemoryKind{"npu", 0});
  ASSERT_FALSE(s.ok());
  const std::string m(s.message());
  EXPECT_THAT(m, HasSubstr("region 3"));
  EXPECT_THAT(m, HasSubstr("libascendcl.so"));
  EXPECT_THAT(m, HasSubstr("set_env.sh"));
  EXPECT_THAT(m, HasSubstr("kv_buffer_device \"cpu\""));
}

// ---- The handle's bytes and the export table (pure logic) ----

TEST(AclExportRefTest, RoundTripsAndRefusesMalformedInput) {
  const AclExportRef ref{"fake:1:2:0:65536", 1234, "kvferry-acl-permit-1234-abc"};
  const std::vector<std::uint8_t> bytes = ref.Encode();
  auto back = AclExportRef::Decode(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->key, ref.key);
  EXPECT_EQ(back->exporter_pid, 1234);
  EXPECT_EQ(back->permit_socket, ref.permit_socket);
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(AclExportRef::Decode(std::span(bytes.data(), n)).ok()) << n << " bytes";
  }
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_FALSE(AclExportRef::Decode(longer).ok());
  auto no_nul = bytes;
  std::fill(no_nul.begin() + 1, no_nul.begin() + 1 + acl::kIpcKeyLength, 'k');
  EXPECT_FALSE(AclExportRef::Decode(no_nul).ok());
  auto version = bytes;
  version[0] = 2;
  EXPECT_FALSE(AclExportRef::Decode(version).ok());
}

TEST(AclExportTableTest, ReadersAreCappedAndExportsTakenOutWithTheirMemory) {
  AclExportTable t;
  t.Add(0x10000, 0x20000, "a");
  t.Add(0x40000, 0x10000, "b");
  EXPECT_EQ(t.Find(0x10000, 0x20000), "a");
  EXPECT_FALSE(t.Find(0x10000, 0x10000).has_value());  // same start, other size
  EXPECT_EQ(t.Reserve("nope", 5).status().code(), StatusCode::kNotFound);
  for (std::int32_t pid = 1; pid <= static_cast<std::int32_t>(AclExportTable::kMaxReadersPerExport);
       ++pid) {
    auto r = t.Reserve("a", pid);
    ASSERT_TRUE(r.ok() && *r) << pid;
  }
  auto again = t.Reserve("a", 7);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(*again);  // already admitted: no second aclrtIpcMemSetImportPid
  EXPECT_EQ(t.Reserve("a", 100000).status().code(), StatusCode::kResourceExhausted);
  t.Unreserve("a", 7);
  EXPECT_TRUE(t.Reserve("a", 100000).ok());
  const auto taken = t.TakeOverlapping(0x2ffff, 1);  // the last byte of "a"
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(taken[0], "a");
  EXPECT_EQ(t.Reserve("a", 1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t.TakeAll(), std::vector<std::string>{"b"});
}

// ---- The device on the fake runtime ----

class AclFakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto rt = AclRuntime::Load({KVFERRY_FAKE_LIBASCENDCL_PATH});
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    rt_ = *rt;
    auto dev = AclDevice::Open(0, rt_);
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    dev_ = std::move(dev).value();
    fake_ = std::make_unique<FakeControls>(KVFERRY_FAKE_LIBASCENDCL_PATH);
    ASSERT_TRUE(fake_->ok());
    violations_at_start_ = fake_->violations();
  }
  void TearDown() override {
    if (fake_ && fake_->ok()) {
      fake_->set_event(acl::ACL_EVENT_RECORDED_STATUS_COMPLETE, acl::ACL_SUCCESS);
      fake_->set_sync_result(acl::ACL_SUCCESS);
      fake_->set_init_result(-1);
    }
    dev_.reset();
    if (fake_ && fake_->ok()) {
      EXPECT_EQ(fake_->violations(), violations_at_start_)
          << "kvferry called the runtime in an order CANN forbids";
      EXPECT_EQ(fake_->live_exports(), 0) << "an export key was left open";
      EXPECT_EQ(fake_->live_imports(), 0) << "an import was left open";
    }
  }

  std::shared_ptr<const AclRuntime> rt_;
  std::unique_ptr<AclDevice> dev_;
  std::unique_ptr<FakeControls> fake_;
  int violations_at_start_ = 0;
};

TEST_F(AclFakeTest, InitAfterTorchNpuIsFineAndOpenChecksTheIndex) {
  // SetUp's load was not the process's first aclInit: ACL_ERROR_REPEAT_INITIALIZE was success.
  auto again = AclRuntime::Load({KVFERRY_FAKE_LIBASCENDCL_PATH});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ((*again)->device_count(), 1);
  EXPECT_TRUE((*again)->has_ipc()) << (*again)->missing_ipc();
  EXPECT_EQ(AclDevice::Open(1, *again).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev_->name(), "npu:0");
  EXPECT_EQ(dev_->kind(), "npu");
  fake_->set_init_result(100000);  // ACL_ERROR_INVALID_PARAM
  auto failed = AclRuntime::Load({KVFERRY_FAKE_LIBASCENDCL_PATH});
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("aclInit failed: aclError 100000"));
}

TEST_F(AclFakeTest, CopiesInEveryDirectionAndQuery) {
  auto a = dev_->Allocate(1 << 20);
  auto b = dev_->Allocate((1 << 20) + 3);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString();
  auto stream = dev_->CreateStream();
  ASSERT_TRUE(stream.ok());
  const auto bytes = PatternBytes(1 << 20, 3);
  ASSERT_TRUE(Upload(**stream, (*a)->address(), bytes).ok());
  ASSERT_TRUE((*stream)->CopyDeviceToDevice((*b)->address() + 3, (*a)->address(), 1 << 20).ok());
  auto back = Download(**stream, (*b)->address() + 3, 1 << 20);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, bytes);
  EXPECT_TRUE((*stream)->CopyHostToDevice((*a)->address(), bytes.data(), 0).ok());  // nothing
  auto info = dev_->Query((*b)->address() + 777);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->alloc_base, (*b)->address());
  EXPECT_EQ(info->alloc_size, 2u << 20);  // rounded up to whole huge pages
  EXPECT_EQ(info->device, "npu:0");
  std::vector<std::byte> host(16);
  EXPECT_EQ(dev_->Query(reinterpret_cast<DeviceAddress>(host.data())).status().code(),
            StatusCode::kNotFound);
  auto pinned = dev_->AllocatePinned(4096);
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ(dev_->Query(reinterpret_cast<DeviceAddress>((*pinned)->data())).status().code(),
            StatusCode::kNotFound);
  // A copy the runtime refuses (host memory named as device memory) is the enqueue's error.
  EXPECT_EQ((*stream)
                ->CopyDeviceToHost(host.data(), reinterpret_cast<DeviceAddress>(host.data()), 16)
                .code(),
            StatusCode::kInvalidArgument);
}

// torch_npu's memory: allocated behind kvferry's back, found through aclrtMemGetAddressRange.
TEST_F(AclFakeTest, QueryFindsMemoryKvferryDidNotAllocate) {
  ASSERT_TRUE(dev_->CreateStream().ok());  // makes the context current on this thread
  void* p = nullptr;
  ASSERT_EQ(fake_->malloc(&p, 3 << 20, acl::ACL_MEM_MALLOC_HUGE_FIRST), acl::ACL_SUCCESS);
  auto info = dev_->Query(reinterpret_cast<DeviceAddress>(p) + 4096);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->alloc_base, reinterpret_cast<DeviceAddress>(p));
  EXPECT_EQ(info->alloc_size, 3u << 20);
  EXPECT_EQ(fake_->free(p), acl::ACL_SUCCESS);
}

// IPC within this process (the fake allows it): the handle names the page-aligned range around
// the allocation plus the offset, the import asks this device's permit server to whitelist this
// process, and the imported mapping reads and writes the same memory.
TEST_F(AclFakeTest, ExportOfAnInnerPointerIsPageAlignedAndAdmitsTheReader) {
  ASSERT_TRUE(dev_->CreateStream().ok());
  void* p = nullptr;  // not a whole number of the fake's 64 KiB pages
  ASSERT_EQ(fake_->malloc(&p, (1 << 20) + 100, acl::ACL_MEM_MALLOC_HUGE_FIRST), acl::ACL_SUCCESS);
  const auto base = reinterpret_cast<DeviceAddress>(p);
  {
    auto handle = dev_->ExportIpc(base + 4096 + 3);
    ASSERT_TRUE(handle.ok()) << handle.status().ToString();
    EXPECT_EQ(handle->kind, "npu");
    EXPECT_EQ(handle->offset, 4096u + 3);
    EXPECT_EQ(handle->alloc_size, (1u << 20) + 65536);  // whole pages
    auto again = dev_->ExportIpc(base + 5);             // one key per allocation
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->opaque, handle->opaque);
    auto ref = AclExportRef::Decode(handle->opaque);
    ASSERT_TRUE(ref.ok());
    EXPECT_EQ(ref->exporter_pid, getpid());
    EXPECT_EQ(fake_->whitelist_size(ref->key.c_str()), 0);
    auto decoded = IpcHandle::Decode(handle->Encode());
    ASSERT_TRUE(decoded.ok());
    auto imported = dev_->ImportIpc(*decoded);
    ASSERT_TRUE(imported.ok()) << imported.status().ToString();
    EXPECT_EQ(fake_->whitelist_size(ref->key.c_str()), 1);  // this process's bare tgid
    auto second = dev_->ImportIpc(*decoded);                // the same import, shared
    ASSERT_TRUE(second.ok());
    EXPECT_EQ((*second)->base(), (*imported)->base());
    EXPECT_EQ(fake_->whitelist_size(ref->key.c_str()), 1);
    EXPECT_EQ(fake_->live_imports(), 1);
    auto stream = dev_->CreateStream();
    ASSERT_TRUE(stream.ok());
    const auto bytes = PatternBytes(4096, 9);
    ASSERT_TRUE(Upload(**stream, (*imported)->address(decoded->offset), bytes).ok());
    auto seen = Download(**stream, base + 4096 + 3, 4096);
    ASSERT_TRUE(seen.ok());
    EXPECT_EQ(*seen, bytes);
    IpcHandle cuda = *decoded;
    cuda.kind = "cuda";
    EXPECT_EQ(dev_->ImportIpc(cuda).status().code(), StatusCode::kInvalidArgument);
  }  // the imports close here, before the exporter's key
  EXPECT_EQ(fake_->live_imports(), 0);
  EXPECT_EQ(fake_->live_exports(), 1);  // foreign memory: the key stays until the device closes
  dev_.reset();
  EXPECT_EQ(fake_->live_exports(), 0);
  EXPECT_EQ(fake_->free(p), acl::ACL_SUCCESS);  // the fake refuses this while the export is open
}

// kvferry's own allocations close their export before aclrtFree (the fake counts a violation,
// and refuses the free, otherwise).
TEST_F(AclFakeTest, AnAllocationClosesItsExportBeforeItIsFreed) {
  auto a = dev_->Allocate(3 << 20);
  ASSERT_TRUE(a.ok());
  auto handle = dev_->ExportIpc((*a)->address() + 100);
  ASSERT_TRUE(handle.ok()) << handle.status().ToString();
  EXPECT_EQ(handle->alloc_size, 4u << 20);
  {
    auto imported = dev_->ImportIpc(*handle);
    ASSERT_TRUE(imported.ok()) << imported.status().ToString();
  }
  EXPECT_EQ(fake_->live_exports(), 1);
  a->reset();
  EXPECT_EQ(fake_->live_exports(), 0);
}

TEST_F(AclFakeTest, PermitsAreCheckedByTheExporter) {
  auto a = dev_->Allocate(1 << 20);
  ASSERT_TRUE(a.ok());
  auto handle = dev_->ExportIpc((*a)->address());
  ASSERT_TRUE(handle.ok()) << handle.status().ToString();
  auto ref = AclExportRef::Decode(handle->opaque);
  ASSERT_TRUE(ref.ok());
  const Deadline soon = DeadlineAfter(std::chrono::seconds(5));
  // The exporter runs in the host's pid namespace here (the fake's bare tgid is the pid): a
  // reader may claim only its own pid.
  const Status other = RequestImportPermit(ref->permit_socket, ref->key, getpid() + 1, soon);
  EXPECT_EQ(other.code(), StatusCode::kUnauthenticated) << other.ToString();
  EXPECT_THAT(std::string(other.message()), HasSubstr("claims bare tgid"));
  const Status stale = RequestImportPermit(ref->permit_socket, "fake:1:2:3:4", getpid(), soon);
  EXPECT_EQ(stale.code(), StatusCode::kNotFound) << stale.ToString();
  const Status nobody = RequestImportPermit("kvferry-acl-permit-nobody", ref->key, getpid(), soon);
  EXPECT_EQ(nobody.code(), StatusCode::kUnavailable) << nobody.ToString();
  EXPECT_THAT(std::string(nobody.message()), HasSubstr("has exited"));
  EXPECT_TRUE(RequestImportPermit(ref->permit_socket, ref->key, getpid(), soon).ok());
  EXPECT_EQ(fake_->whitelist_size(ref->key.c_str()), 1);
  // A handle whose permit socket nobody serves does not import: shm then uses tcp.
  AclExportRef lost = *ref;
  lost.permit_socket = "kvferry-acl-permit-gone";
  IpcHandle gone = *handle;
  gone.opaque = lost.Encode();
  auto imported = dev_->ImportIpc(gone);
  EXPECT_EQ(imported.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(std::string(imported.status().message()), HasSubstr("did not admit this process"));
}

TEST_F(AclFakeTest, EventStatesFollowAclrtQueryEventStatus) {
  auto stream = dev_->CreateStream();
  ASSERT_TRUE(stream.ok());
  fake_->set_event(acl::ACL_EVENT_RECORDED_STATUS_NOT_READY, acl::ACL_SUCCESS);
  auto event = (*stream)->RecordEvent();
  ASSERT_TRUE(event.ok());
  EXPECT_EQ((*event)->Poll().state, EventState::kPending);
  EXPECT_EQ((*event)->Wait(DeadlineAfter(std::chrono::milliseconds(20))).code(),
            StatusCode::kTimeout);
  fake_->set_event(acl::ACL_EVENT_RECORDED_STATUS_COMPLETE, acl::ACL_SUCCESS);
  EXPECT_TRUE((*event)->Wait(DeadlineAfter(std::chrono::seconds(10))).ok());
  fake_->set_event(acl::ACL_EVENT_RECORDED_STATUS_COMPLETE, 507011);  // an asynchronous error
  const EventPoll failed = (*event)->Poll();
  EXPECT_EQ(failed.state, EventState::kFailed);
  EXPECT_THAT(std::string(failed.status.message()), HasSubstr("aclError 507011"));
  EXPECT_FALSE((*event)->Wait(DeadlineAfter(std::chrono::seconds(10))).ok());
  fake_->set_event(7, acl::ACL_SUCCESS);  // neither state
  EXPECT_EQ((*event)->Poll().state, EventState::kFailed);
}

TEST_F(AclFakeTest, RecordEventOnANativeStream) {
  auto stream = dev_->CreateStream();
  ASSERT_TRUE(stream.ok());
  auto event = dev_->RecordEventOn((*stream)->native_handle());
  ASSERT_TRUE(event.ok()) << event.status().ToString();
  EXPECT_TRUE((*event)->Wait(DeadlineAfter(std::chrono::seconds(1))).ok());
  EXPECT_TRUE(dev_->RecordEventOn(0).ok());  // the context's default stream
  int not_a_stream = 0;
  EXPECT_EQ(dev_->RecordEventOn(reinterpret_cast<std::uint64_t>(&not_a_stream)).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(AclFakeTest, AStreamStillBusyAfterTenSecondsIsLeftUndestroyed) {
  const int before = fake_->live_streams();
  {
    auto stream = dev_->CreateStream();
    ASSERT_TRUE(stream.ok());
  }
  EXPECT_EQ(fake_->live_streams(), before);
  LogCapture log;
  fake_->set_sync_result(acl::kStreamSyncTimeout);
  {
    auto stream = dev_->CreateStream();
    ASSERT_TRUE(stream.ok());
  }
  EXPECT_EQ(fake_->live_streams(), before + 1);
  EXPECT_EQ(log.Count("left undestroyed"), 1u) << log.Text();
}

// Every thread makes the device's context current itself (the fake refuses calls without one).
TEST_F(AclFakeTest, ThreadsThatNeverSetTheDeviceCanUseIt) {
  auto a = dev_->Allocate(1 << 20);
  ASSERT_TRUE(a.ok());
  Status result = Status::Internal("did not run");
  std::thread t([&] {
    auto stream = dev_->CreateStream();
    if (!stream.ok()) {
      result = stream.status();
      return;
    }
    result = Upload(**stream, (*a)->address(), PatternBytes(4096, 1));
  });
  t.join();
  EXPECT_TRUE(result.ok()) << result.ToString();
}

// A runtime older than CANN 8.2.RC1: no IPC (reads stage, said once in the log), and no
// aclrtMemGetAddressRange (only kvferry's own allocations are known).
TEST(AclOldRuntimeTest, NoIpcAndNoAddressRangeAreSaidPlainly) {
  auto rt = AclRuntime::Load({KVFERRY_FAKE_LIBASCENDCL_OLD_PATH});
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  EXPECT_FALSE((*rt)->has_ipc());
  EXPECT_THAT((*rt)->missing_ipc(), HasSubstr("aclrtIpcMemGetExportKey"));
  auto dev = AclDevice::Open(0, *rt);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  auto a = (*dev)->Allocate(1 << 20);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE((*dev)->Query((*a)->address() + 10).ok());
  LogCapture log;
  for (int i = 0; i < 3; ++i) {
    auto h = (*dev)->ExportIpc((*a)->address());
    ASSERT_EQ(h.status().code(), StatusCode::kNotSupported) << h.status().ToString();
    EXPECT_THAT(std::string(h.status().message()), HasSubstr("CANN 8.2.RC1"));
  }
  EXPECT_EQ(log.Count("lacks aclrtIpcMemGetExportKey"), 1u) << log.Text();
  FakeControls fake(KVFERRY_FAKE_LIBASCENDCL_OLD_PATH);
  ASSERT_TRUE(fake.ok());
  void* p = nullptr;
  ASSERT_EQ(fake.malloc(&p, 1 << 20, acl::ACL_MEM_MALLOC_HUGE_FIRST), acl::ACL_SUCCESS);
  auto foreign = (*dev)->Query(reinterpret_cast<DeviceAddress>(p));
  EXPECT_EQ(foreign.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(std::string(foreign.status().message()), HasSubstr("aclrtMemGetAddressRange"));
  EXPECT_EQ(fake.free(p), acl::ACL_SUCCESS);
  IpcHandle h{"npu", 0, 1 << 20, 0, AclExportRef{"k", 1, "s"}.Encode()};
  auto imported = (*dev)->ImportIpc(h);
  EXPECT_EQ(imported.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(std::string(imported.status().message()), HasSubstr("aclrtIpcMemImportByKey"));
}

}  // namespace
}  // namespace kvferry::device
