#include "transport/tcp/send_stage.h"

#include <algorithm>
#include <chrono>

#include "common/clock.h"

namespace kvferry::tcp {

SendStage::~SendStage() { Reset(); }

std::uint64_t SendStage::pinned_bytes() const {
  std::uint64_t n = 0;
  for (const Slot& s : slots_) {
    if (s.buffer) n += s.buffer->size();
  }
  return n;
}

void SendStage::Reset() {
  for (Slot& s : slots_) {
    if (s.event && !s.event->Wait(DeadlineAfter(kCopyWait)).ok()) {
      (void)s.buffer.release();  // a copy may still write into it: never free it
    }
    if (s.buffer && gauge_ != nullptr) gauge_->fetch_sub(s.buffer->size());
    s = Slot{};
  }
  stream_.reset();
  dev_ = nullptr;
  broken_ = false;
}

Status SendStage::Finish(Slot& slot) {
  if (!slot.event) return Status::Ok();
  Status s = slot.event->Wait(DeadlineAfter(kCopyWait));
  slot.event.reset();
  if (s.ok()) return s;
  (void)slot.buffer.release();  // the copy may still run into it
  slot = Slot{};
  broken_ = true;
  return s;
}

Status SendStage::Fill(Slot& slot, const StagedBody& r, std::size_t entry, std::uint64_t skip) {
  slot.serial = 0;
  slot.pieces.clear();
  slot.total = 0;
  if (!slot.buffer) {
    Result<std::unique_ptr<device::PinnedBuffer>> buffer = dev_->AllocatePinned(kBytes);
    if (!buffer.ok()) return buffer.status();
    slot.buffer = std::move(buffer).value();
    if (gauge_ != nullptr) gauge_->fetch_add(slot.buffer->size());
  }
  Status copy;
  for (std::size_t j = entry; j < r.body.size() && slot.total < kBytes; ++j) {
    if (r.devices[j] != dev_) break;
    const std::uint64_t from = j == entry ? skip : 0;
    const std::uint64_t len =
        std::min<std::uint64_t>(kBytes - slot.total, r.body[j].iov_len - from);
    const auto src =
        reinterpret_cast<device::DeviceAddress>(static_cast<std::byte*>(r.body[j].iov_base)) + from;
    copy = stream_->CopyDeviceToHost(slot.buffer->data() + slot.total, src, len);
    if (!copy.ok()) break;
    slot.pieces.push_back({j, from, len, slot.total});
    slot.total += len;
    if (from + len < r.body[j].iov_len) break;  // the buffer is full
  }
  // Recorded even after a failed copy, so that the copies issued are waited for.
  Result<std::unique_ptr<device::Event>> event = stream_->RecordEvent();
  if (!event.ok()) {
    (void)slot.buffer.release();  // copies may have been issued that cannot be waited for
    slot = Slot{};
    broken_ = true;
    return event.status();
  }
  slot.event = std::move(event).value();
  if (!copy.ok()) {
    if (Finish(slot).ok()) slot.pieces.clear();
    broken_ = true;
    return copy;
  }
  slot.serial = r.serial;
  return Status::Ok();
}

void SendStage::Prefetch(const Slot& held, const StagedBody& r, const StagedBody* next) {
  const Piece& last = held.pieces.back();
  const StagedBody* body = &r;
  std::size_t j = last.entry;
  std::uint64_t from = last.from + last.len;
  if (from == r.body[j].iov_len) {
    ++j;
    from = 0;
  }
  while (j < body->body.size() && body->devices[j] == nullptr) {
    ++j;
    from = 0;
  }
  if (j == body->body.size()) {
    if (next == nullptr || next->devices.empty()) return;
    body = next;
    for (j = 0; j < body->body.size() && body->devices[j] == nullptr; ++j) {
    }
    if (j == body->body.size()) return;
  }
  if (body->devices[j] != dev_) return;  // another device: staged when it is reached
  Slot& other = &held == &slots_[0] ? slots_[1] : slots_[0];
  if (other.serial == body->serial && !other.pieces.empty() && other.pieces[0].entry == j &&
      other.pieces[0].from == from) {
    return;  // already there, or on its way
  }
  if (!Finish(other).ok()) return;    // the stage is broken; the next Bytes call starts afresh
  (void)Fill(other, *body, j, from);  // a failure marks the stage broken, likewise
}

Result<std::span<const std::byte>> SendStage::Bytes(const StagedBody& r, std::size_t entry,
                                                    std::uint64_t skip, const StagedBody* next) {
  device::Device* dev = r.devices[entry];
  if (broken_ || dev != dev_) Reset();
  dev_ = dev;
  if (!stream_) {
    Result<std::unique_ptr<device::Stream>> stream = dev->CreateStream();
    if (!stream.ok()) return stream.status();
    stream_ = std::move(stream).value();
  }
  Slot* found = nullptr;
  std::uint64_t pos = 0;
  for (Slot& s : slots_) {
    if (s.serial != r.serial) continue;
    for (const Piece& p : s.pieces) {
      if (p.entry == entry && p.from <= skip && skip < p.from + p.len) {
        found = &s;
        pos = p.at + (skip - p.from);
        break;
      }
    }
    if (found != nullptr) break;
  }
  if (found == nullptr) {
    found = slots_[0].event && !slots_[1].event ? &slots_[1] : &slots_[0];
    KVFERRY_RETURN_IF_ERROR(Finish(*found));
    KVFERRY_RETURN_IF_ERROR(Fill(*found, r, entry, skip));
    pos = 0;
  }
  KVFERRY_RETURN_IF_ERROR(Finish(*found));
  // The other slot's bytes (if any) were sent already: it takes what follows these.
  Prefetch(*found, r, next);
  return std::span<const std::byte>(found->buffer->data() + pos, found->total - pos);
}

}  // namespace kvferry::tcp
