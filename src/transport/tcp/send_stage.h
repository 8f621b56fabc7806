// The tcp server's way out for device memory: a connection's response bytes that live on a device
// are copied into one of two pinned host buffers and sent from there, and while one buffer is on
// the wire the next bytes are already being copied into the other (docs/device.md, "tcp").
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "device/device.h"
#include "kvferry/status.h"

namespace kvferry::tcp {

/// How long a staged device copy may take (sending or receiving); one that takes longer fails.
inline constexpr std::chrono::seconds kCopyWait{10};

/// A response's body as the stage sees it: entries of registered memory, each on a device or in
/// host memory (null), and the response's serial number on its connection (never 0, never reused).
struct StagedBody {
  std::uint64_t serial = 0;
  std::span<const iovec> body;
  std::span<device::Device* const> devices;  // in step with body
};

/// Two pinned buffers of `kBytes` each per connection (bounded: 2 * kBytes of pinned memory), one
/// stream, on one device at a time. Not thread-safe: the connection's thread only.
class SendStage {
 public:
  static constexpr std::uint64_t kBytes = std::uint64_t{2} << 20;

  SendStage() = default;
  SendStage(const SendStage&) = delete;
  SendStage& operator=(const SendStage&) = delete;
  /// Waits (bounded) for copies still running into the buffers; a buffer whose copy does not end
  /// in time is leaked rather than freed under the copy.
  ~SendStage();

  /// Host bytes equal to `r`'s payload from byte `skip` of device entry `entry` on, as many
  /// consecutive payload bytes as one buffer holds (at least one). Copies them from the device
  /// unless a buffer holds them already, then starts copying the bytes that follow (in `r`, else
  /// in `next`, the response to be sent after it, if any) into the other buffer. The span stays
  /// valid until the next call. A failed copy is the device's error, and the stage then starts
  /// afresh (the connection should be closed: its payload cannot be completed).
  Result<std::span<const std::byte>> Bytes(const StagedBody& r, std::size_t entry,
                                           std::uint64_t skip, const StagedBody* next);

  /// Pinned bytes held now (0 before the first device response); never above 2 * kBytes.
  std::uint64_t pinned_bytes() const;
  /// Also keeps `gauge` up to date with the pinned bytes held (a buffer leaked after a copy that
  /// did not end stays counted). Call before the first Bytes; `gauge` must outlive the stage.
  void CountIn(std::atomic<std::uint64_t>* gauge) { gauge_ = gauge; }

 private:
  struct Piece {
    std::size_t entry;   // body entry
    std::uint64_t from;  // first byte of the entry held
    std::uint64_t len;   // bytes of it held
    std::uint64_t at;    // where in the buffer
  };
  struct Slot {
    std::unique_ptr<device::PinnedBuffer> buffer;
    std::unique_ptr<device::Event> event;  // the copies into `buffer`, until waited for
    std::uint64_t serial = 0;              // the response whose bytes it holds; 0: none
    std::vector<Piece> pieces;             // consecutive payload bytes, in buffer order
    std::uint64_t total = 0;
  };

  // Issues the copies of `r`'s bytes from (entry, skip) into `slot` (which has no copy running),
  // up to a full buffer or the end of `r`'s run on the stage's device, and records their event.
  Status Fill(Slot& slot, const StagedBody& r, std::size_t entry, std::uint64_t skip);
  // Waits for `slot`'s copies. On failure the slot's buffer is leaked (a copy may still write into
  // it) and the stage is marked broken.
  Status Finish(Slot& slot);
  // Starts copying what follows `held` (in `r`, else the first device bytes of `next`) into the
  // other slot, unless it holds those bytes already or they are on another device. A failure
  // only marks the stage broken: `held` stays valid.
  void Prefetch(const Slot& held, const StagedBody& r, const StagedBody* next);
  // Waits (bounded) for copies still running, then forgets the device, stream and buffers; a
  // buffer whose copy did not end in time is leaked.
  void Reset();

  device::Device* dev_ = nullptr;
  std::unique_ptr<device::Stream> stream_;
  Slot slots_[2];
  std::atomic<std::uint64_t>* gauge_ = nullptr;
  bool broken_ = false;  // a copy failed: the next Bytes call starts afresh
};

}  // namespace kvferry::tcp
