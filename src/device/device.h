// The device layer: the one place where kvferry touches accelerator memory (docs/device.md).
//
// Device memory is named by a DeviceAddress (an integer, never a host pointer): code outside
// src/device/ must not dereference, memcpy or offset into it as if it were host memory. The sim
// device makes such code crash (its addresses are PROT_NONE in the host address space).
//
// Every implementation lives in one folder (src/device/sim/, src/device/cuda/, src/device/acl/)
// and is reached through OpenDevice("<kind>:<index>"); nothing outside the folder names its types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"
#include "kvferry/transport.h"  // Deadline

namespace kvferry::device {

/// An address in a device's address space. For cuda it is a CUdeviceptr; for npu an ACL device
/// pointer; for sim an address of a PROT_NONE reservation. In every case: not host-dereferenceable.
using DeviceAddress = std::uint64_t;

/// What a device knows about one of its addresses.
struct PointerInfo {
  std::string device;            ///< the device's name, e.g. "cuda:0", "npu:0", "sim:1"
  int device_index = 0;          ///< the ordinal in `device`
  DeviceAddress alloc_base = 0;  ///< first byte of the allocation that holds the address
  std::uint64_t alloc_size = 0;  ///< bytes in that allocation
};

/// An allocation exported for another process on the same host. A plain value: encode it, send it
/// (e.g. in a descriptor), decode it and pass it to ImportIpc in the other process. Format of
/// Encode(), version 1, native byte order (same host only): "KVDH", u8 version, u8 kind length,
/// kind bytes, i32 device index, u64 alloc_size, u64 offset, u32 opaque length, opaque bytes.
struct IpcHandle {
  std::string kind;                  ///< "sim", "cuda" or "npu": the implementation that imports it
  int device_index = 0;              ///< the exporting device's ordinal
  std::uint64_t alloc_size = 0;      ///< bytes of the whole exported allocation
  std::uint64_t offset = 0;          ///< the exported address minus the allocation base
  std::vector<std::uint8_t> opaque;  ///< implementation bytes (cuda: CUipcMemHandle; npu: key)

  std::vector<std::uint8_t> Encode() const;
  /// Never trusts `bytes`: any malformed input is InvalidArgument.
  static Result<IpcHandle> Decode(std::span<const std::uint8_t> bytes);
};

/// Memory allocated on a device by Device::Allocate. Freed by the destructor, which the caller must
/// not run while copies that touch it are in flight (wait for their events first).
class DeviceAllocation {
 public:
  virtual ~DeviceAllocation() = default;
  virtual DeviceAddress address() const = 0;
  virtual std::uint64_t size() const = 0;
};

/// Another process's allocation mapped into this one by Device::ImportIpc. `address()` is the
/// exported address (allocation base + offset); the mapping covers [base(), base() + size()).
/// Unmapped by the destructor (same rule as DeviceAllocation about in-flight copies).
class ImportedMemory {
 public:
  virtual ~ImportedMemory() = default;
  virtual DeviceAddress base() const = 0;
  virtual std::uint64_t size() const = 0;
  DeviceAddress address(std::uint64_t offset) const { return base() + offset; }
};

/// Host memory the device can copy to and from asynchronously (cuda: cuMemHostAlloc; npu:
/// aclrtMallocHost; sim: page aligned anonymous memory). Host-dereferenceable. Freed by the
/// destructor.
class PinnedBuffer {
 public:
  virtual ~PinnedBuffer() = default;
  virtual std::byte* data() const = 0;
  virtual std::uint64_t size() const = 0;
};

/// Whether the copies an event follows have finished.
enum class EventState : std::uint8_t {
  kPending,   ///< not yet; poll again or Wait
  kComplete,  ///< every copy enqueued on the stream before the event has finished
  kFailed,    ///< a copy before it failed; the Status says how. The stream is unusable.
};

/// What Event::Poll returns: a state plus, for kFailed, the error ("in progress" is a state).
struct EventPoll {
  EventState state = EventState::kPending;
  Status status;
};

/// A completion marker on a stream. Thread-safe: any thread may Poll or Wait.
class Event {
 public:
  virtual ~Event() = default;
  /// Never blocks.
  virtual EventPoll Poll() = 0;
  /// Blocks until the event completes (OK), fails (its error) or `deadline` passes (Timeout, the
  /// copies continue and the event can be waited on again).
  virtual Status Wait(Deadline deadline) = 0;
};

/// Waits for `event` by polling it, with a pause that grows from 5 us to 1 ms, until it completes
/// (OK), fails (its error) or `deadline` passes (Timeout: "<what>: the copies before it had not
/// finished by the deadline"). For runtimes whose own wait has no deadline (cuda, npu).
Status PollEventUntil(Event& event, Deadline deadline, std::string_view what);

/// An ordered queue of asynchronous copies on one device. Copies run in enqueue order. Enqueue
/// calls check their arguments (both ranges must lie inside memory this device knows: an
/// allocation, an import, or for host sides any host memory; cuda needs pinned host memory for the
/// copy to be asynchronous) and return at once; the copy's completion is known only through a
/// later RecordEvent. The caller keeps both ranges alive and unchanged until then.
/// Not thread-safe: one thread enqueues at a time. The destructor does not cancel enqueued copies
/// (sim: it runs them first; cuda: it returns at once and the driver finishes them; npu: it waits
/// for them, at most 10 s): wait for an event before freeing memory they touch.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual Status CopyHostToDevice(DeviceAddress dst, const std::byte* src, std::uint64_t size) = 0;
  virtual Status CopyDeviceToHost(std::byte* dst, DeviceAddress src, std::uint64_t size) = 0;
  virtual Status CopyDeviceToDevice(DeviceAddress dst, DeviceAddress src, std::uint64_t size) = 0;
  /// An event that completes when every copy enqueued so far has.
  virtual Result<std::unique_ptr<Event>> RecordEvent() = 0;
  /// The device's own name for this stream (cuda: its CUstream; npu: its aclrtStream), which
  /// Device::RecordEventOn takes; valid while the stream lives.
  virtual std::uint64_t native_handle() const = 0;
};

/// One device (a GPU, an NPU, a simulated device). Thread-safe. Objects it returns (allocations,
/// imports, streams, pinned buffers) must be destroyed before it.
class Device {
 public:
  virtual ~Device() = default;

  /// "<kind>:<index>", e.g. "cuda:0", "npu:0".
  virtual const std::string& name() const = 0;
  virtual std::string_view kind() const = 0;
  virtual int index() const = 0;

  /// Which allocation of this device holds `address`. NotFound when the device does not know the
  /// address (e.g. host memory, or another device's memory).
  virtual Result<PointerInfo> Query(DeviceAddress address) const = 0;

  virtual Result<std::unique_ptr<DeviceAllocation>> Allocate(std::uint64_t size) = 0;
  virtual Result<std::unique_ptr<PinnedBuffer>> AllocatePinned(std::uint64_t size) = 0;

  /// Exports the allocation that holds `address` (handle offset = address - base) for a process on
  /// the same host. NotSupported when the allocation cannot be exported (cuda: VMM allocations,
  /// expandable segments; npu: a CANN without the IPC calls): the caller then stages through host
  /// memory.
  virtual Result<IpcHandle> ExportIpc(DeviceAddress address) = 0;
  /// Maps an allocation exported by another process. InvalidArgument for a handle of another kind;
  /// Unavailable when the exporter or its allocation is gone or cannot be opened.
  virtual Result<std::unique_ptr<ImportedMemory>> ImportIpc(const IpcHandle& handle) = 0;

  virtual Result<std::unique_ptr<Stream>> CreateStream() = 0;
  /// An event that completes when the work queued so far on the stream `native_stream` has: a
  /// stream the engine made itself (cuda: a CUstream of this device's primary context, such as
  /// torch's current stream; npu: an aclrtStream of this device's default context, such as
  /// torch_npu's current stream), or one of this device's Streams by its native_handle(). The
  /// stream must live until the call returns. InvalidArgument for a stream this device does not
  /// know (sim), or the driver's or runtime's refusal (cuda, npu).
  virtual Result<std::unique_ptr<Event>> RecordEventOn(std::uint64_t native_stream) = 0;
};

/// Whether this build has a device implementation called `type` ("sim", "cuda", "npu"); whether a
/// device of it exists here is OpenDevice's answer.
bool KnownDeviceType(std::string_view type);

/// Opens a device by name: "sim:N" (a fresh simulated device with default options), "cuda:N" or
/// "npu:N" (an Ascend NPU through CANN's ACL runtime). cuda without a driver or device is
/// Unavailable ("no CUDA driver ..."), npu without CANN or an NPU too ("no NPU runtime: ...",
/// naming libascendcl.so, where it was looked for and the way out); an unknown kind is
/// InvalidArgument naming the kinds this build has.
Result<std::unique_ptr<Device>> OpenDevice(std::string_view name);

/// The device of this process called `name` ("sim:0", "cuda:1", "npu:0"): opened by the first call,
/// the same object for every later call, never closed. Memory that kvferry's transport reads or
/// serves (regions registered with a device MemoryKind) must come from this device, so that the
/// transport and the code that allocated the memory share one address space of the device.
/// Errors as OpenDevice's; a failed open is not remembered (the next call tries again).
Result<Device*> ProcessDevice(std::string_view name);

}  // namespace kvferry::device
