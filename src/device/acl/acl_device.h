// The acl device: one Ascend NPU through CANN's ACL runtime, loaded at run time (docs/device.md,
// "The acl device"). Named "npu:N", as vllm-ascend and torch_npu name the device type.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "common/mutex.h"
#include "device/acl/acl_runtime.h"
#include "device/device.h"

namespace kvferry::device {

struct AclShared;  // acl_device.cc: what the device's objects share (runtime, context, tables)
class AclPermitServer;

/// Uses the device's default context (the one aclrtSetDevice creates and torch_npu uses), made
/// current on the calling thread by every method. Never resets the device and never calls
/// aclFinalize: the context and the runtime belong to the process (torch_npu shares them).
/// Thread-safe.
class AclDevice final : public Device {
 public:
  /// Loads the runtime (AclRuntime::Load) and sets device `index` up. Unavailable "no NPU runtime
  /// ..." / "no NPU device ..." where there is none; InvalidArgument for an index past the count.
  static Result<std::unique_ptr<AclDevice>> Open(int index);
  static Result<std::unique_ptr<AclDevice>> Open(int index,
                                                 std::shared_ptr<const AclRuntime> runtime);
  /// Stops the IPC permit server and closes every export key still open. Allocations, imports,
  /// streams and pinned buffers must be gone already.
  ~AclDevice() override;

  const std::string& name() const override;
  std::string_view kind() const override { return "npu"; }
  int index() const override;

  /// Memory this device allocated (Allocate) is known from its own table. Other memory (e.g.
  /// torch_npu's) through aclrtPointerGetAttributes (device memory of this NPU) and
  /// aclrtMemGetAddressRange; where the runtime lacks either, NotFound saying so.
  Result<PointerInfo> Query(DeviceAddress address) const override;
  /// aclrtMalloc(ACL_MEM_MALLOC_HUGE_FIRST) of `size` rounded up to 2 MiB, so that the allocation
  /// is a whole number of huge pages and can be exported on its own.
  Result<std::unique_ptr<DeviceAllocation>> Allocate(std::uint64_t size) override;
  /// aclrtMallocHost.
  Result<std::unique_ptr<PinnedBuffer>> AllocatePinned(std::uint64_t size) override;
  /// aclrtIpcMemGetExportKey of the page-aligned range around the allocation that holds
  /// `address` (one key per allocation, reused), plus the offset and this device's permit socket
  /// (acl_permit.h). NotSupported, logged once, where the runtime lacks the IPC calls (CANN older
  /// than 8.2.RC1) or refuses the export: the caller stages through host memory.
  Result<IpcHandle> ExportIpc(DeviceAddress address) override;
  /// Asks the exporter to admit this process (its aclrtDeviceGetBareTgid) and then
  /// aclrtIpcMemImportByKey; one import per key, shared by the ImportedMemory objects of it, closed
  /// (aclrtIpcMemClose) when the last one goes. Imports are made one at a time, each waiting at
  /// most 5 s for the exporter's answer. Unavailable when the runtime lacks the IPC calls, the
  /// exporter is gone or refuses, or the import fails.
  Result<std::unique_ptr<ImportedMemory>> ImportIpc(const IpcHandle& handle) override;
  /// aclrtCreateStream. Its destructor waits for the stream's copies (at most 10 s,
  /// aclrtSynchronizeStreamWithTimeout) before aclrtDestroyStream; a stream still busy then is
  /// left undestroyed (logged), since destroying it would wait without a deadline.
  Result<std::unique_ptr<Stream>> CreateStream() override;
  /// aclrtCreateEvent + aclrtRecordEvent on the aclrtStream `native_stream` (e.g. torch_npu's
  /// current stream; 0 is the context's default stream).
  Result<std::unique_ptr<Event>> RecordEventOn(std::uint64_t native_stream) override;

 private:
  explicit AclDevice(std::shared_ptr<AclShared> shared);
  Result<std::string> ExportKey(DeviceAddress start, std::uint64_t size) EXCLUDES(export_mu_);
  Result<std::string> PermitSocket() EXCLUDES(server_mu_);

  std::shared_ptr<AclShared> s_;
  Mutex export_mu_;  // one export at a time, so an allocation is exported once
  Mutex import_mu_;  // one import at a time, so a key is imported once
  Mutex server_mu_;
  std::unique_ptr<AclPermitServer> server_ GUARDED_BY(server_mu_);
  std::atomic<bool> export_fallback_logged_{false};
};

}  // namespace kvferry::device
