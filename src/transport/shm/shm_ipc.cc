#include "transport/shm/shm_ipc.h"

#include <algorithm>

#include "common/clock.h"
#include "common/log.h"

namespace kvferry {
namespace {

constexpr std::chrono::seconds kCopyWait(10);  // issued copies a cancelled unit waits for

}  // namespace

Result<std::unique_ptr<device::Stream>> StreamPool::Take() {
  {
    MutexLock lock(mu_);
    if (!idle_.empty()) {
      auto s = std::move(idle_.back());
      idle_.pop_back();
      return s;
    }
  }
  return device_->CreateStream();
}

void StreamPool::Give(std::unique_ptr<device::Stream> s) {
  MutexLock lock(mu_);
  idle_.push_back(std::move(s));
}

Result<std::unique_ptr<StagingLane>> StagingLanes::Take() {
  {
    MutexLock lock(mu_);
    if (!idle_.empty()) {
      auto lane = std::move(idle_.back());
      idle_.pop_back();
      return lane;
    }
  }
  auto lane = std::make_unique<StagingLane>(gauge_.get());
  KVFERRY_ASSIGN_OR_RETURN(lane->stream, device_->CreateStream());
  for (auto& buffer : lane->buffers) {
    KVFERRY_ASSIGN_OR_RETURN(buffer, device_->AllocatePinned(kBufferBytes));
    gauge_->fetch_add(buffer->size());
  }
  return lane;
}

void StagingLanes::Give(std::unique_ptr<StagingLane> lane) {
  MutexLock lock(mu_);
  idle_.push_back(std::move(lane));
}

Status StageToDevice(const std::function<Status(std::vector<HostRead>&, std::uint64_t*)>& read,
                     const Batch& batch, StagingLanes& lanes, const std::vector<StagedRead>& pieces,
                     std::uint64_t* bytes) {
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<StagingLane> lane, lanes.Take());
  std::unique_ptr<device::Event> pending[2];  // the copy out of each buffer, until waited for
  bool broken = false;                        // a copy failed: the stream is unusable
  bool running = false;  // a copy did not end in time: it may still read the buffers
  const auto wait = [&](std::unique_ptr<device::Event>& event) {
    Status w = event->Wait(DeadlineAfter(kCopyWait));
    event.reset();
    if (!w.ok()) {
      broken = true;
      running = running || w.code() == StatusCode::kTimeout;
    }
    return w;
  };
  Status result;
  std::uint64_t moved = 0;
  std::size_t next = 0;    // piece
  std::uint64_t done = 0;  // bytes of pieces[next] already staged
  for (int slot = 0; next < pieces.size(); slot ^= 1) {
    if (pending[slot]) {
      result = wait(pending[slot]);
      if (!result.ok()) break;
    }
    if (batch.ShouldStop()) {
      result = batch.StopStatus();
      break;
    }
    // One buffer's worth: the rest of pieces[next] and the pieces after it, the last maybe cut.
    std::byte* buffer = lane->buffers[slot]->data();
    std::vector<HostRead> reads;
    struct Copy {
      device::DeviceAddress dst;
      std::uint64_t at;  // in the buffer
      std::uint64_t len;
    };
    std::vector<Copy> copies;
    std::uint64_t total = 0;
    while (next < pieces.size() && total < StagingLanes::kBufferBytes) {
      const StagedRead& p = pieces[next];
      const std::uint64_t len = std::min(StagingLanes::kBufferBytes - total, p.length - done);
      reads.push_back({buffer + total, p.remote_addr + done, len});
      copies.push_back({p.local + done, total, len});
      total += len;
      done += len;
      if (done == p.length) {
        ++next;
        done = 0;
      }
    }
    std::uint64_t read_bytes = 0;
    result = read(reads, &read_bytes);
    if (!result.ok()) break;
    for (const Copy& c : copies) {
      result = lane->stream->CopyHostToDevice(c.dst, buffer + c.at, c.len);
      if (!result.ok()) break;
    }
    // Recorded even after a failed copy, so that the copies issued are waited for below.
    Result<std::unique_ptr<device::Event>> event = lane->stream->RecordEvent();
    if (!event.ok()) {
      (void)lane.release();  // copies may read its buffers and cannot be waited for
      return event.status();
    }
    pending[slot] = std::move(event).value();
    if (!result.ok()) break;
    moved += total;
  }
  for (auto& event : pending) {
    if (!event) continue;
    Status waited = wait(event);
    if (!waited.ok() && result.ok()) result = waited;
  }
  if (running) {
    (void)lane.release();  // a copy may still read its buffers: never free them
    return Status::Internal("copies into device memory did not end " +
                            std::to_string(kCopyWait.count()) + " s after they were issued");
  }
  if (!broken) lanes.Give(std::move(lane));
  if (!result.ok()) return result;
  *bytes += moved;
  return Status::Ok();
}

std::vector<ShmIpcRegion> ExportDeviceRegions(const std::vector<RegionInfo>& regions) {
  std::vector<ShmIpcRegion> out;
  for (const RegionInfo& r : regions) {
    if (r.kind.is_host()) continue;
    Result<device::Device*> dev = device::ProcessDevice(r.kind.ToString());
    Result<device::IpcHandle> h =
        dev.ok() ? (*dev)->ExportIpc(reinterpret_cast<device::DeviceAddress>(r.addr))
                 : Result<device::IpcHandle>(dev.status());
    if (!h.ok()) {
      Log().info("shm: region {} ({} memory) is not offered for IPC: {}", r.id, r.kind.ToString(),
                 h.status().ToString());
      continue;
    }
    out.push_back({r.id, h->Encode()});
  }
  return out;
}

Result<std::map<RegionId, ImportedRegion>> ImportPeerRegions(const std::vector<ShmIpcRegion>& ipc,
                                                             const RemoteRegionTable& table) {
  std::map<RegionId, ImportedRegion> imported;
  std::map<std::vector<std::uint8_t>, std::shared_ptr<device::ImportedMemory>> opened;
  for (const ShmIpcRegion& e : ipc) {
    auto region = table.find(e.region);
    if (region == table.end() || region->second.kind.is_host()) continue;
    KVFERRY_ASSIGN_OR_RETURN(device::IpcHandle h, device::IpcHandle::Decode(e.bytes));
    const std::string name = h.kind + ":" + std::to_string(h.device_index);
    if (name != region->second.kind.ToString()) {
      return Status::InvalidArgument("the peer's IPC handle of region " + std::to_string(e.region) +
                                     " is for " + name + ", but the region is " +
                                     region->second.kind.ToString() + " memory");
    }
    Result<device::Device*> dev = device::ProcessDevice(name);
    if (!dev.ok()) {
      return Status::Unavailable("shm cannot open " + name + ": " + dev.status().ToString());
    }
    std::shared_ptr<device::ImportedMemory>& mem = opened[e.bytes];
    if (!mem) {
      Result<std::unique_ptr<device::ImportedMemory>> m = (*dev)->ImportIpc(h);
      if (!m.ok()) {
        return Status::Unavailable("opening the peer's IPC handle of region " +
                                   std::to_string(e.region) + " failed: " + m.status().ToString());
      }
      mem = std::move(m).value();
    }
    if (h.offset + region->second.length > mem->size()) {
      return Status::InvalidArgument("the peer's region " + std::to_string(e.region) +
                                     " runs past the allocation its IPC handle opens");
    }
    imported[e.region] = ImportedRegion{*dev, mem, h.offset};
  }
  return imported;
}

Status CopyPieces(const std::function<Status()>& alive, const Batch& batch, StreamPool& streams,
                  const std::vector<DevicePiece>& pieces, std::uint64_t* bytes) {
  KVFERRY_RETURN_IF_ERROR(alive());
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::Stream> stream, streams.Take());
  Status issued;
  std::uint64_t total = 0;
  for (const DevicePiece& p : pieces) {
    issued = p.local_host
                 ? stream->CopyDeviceToHost(p.local, p.remote, p.length)
                 : stream->CopyDeviceToDevice(reinterpret_cast<device::DeviceAddress>(p.local),
                                              p.remote, p.length);
    if (!issued.ok()) break;
    total += p.length;
  }
  Result<std::unique_ptr<device::Event>> event = stream->RecordEvent();
  if (!event.ok()) return event.status();  // the stream is dropped with its copies
  Status waited = Status::Timeout("");
  while (waited.code() == StatusCode::kTimeout && !batch.ShouldStop() &&
         Clock::now() < batch.deadline()) {
    waited =
        (*event)->Wait(std::min(batch.deadline(), DeadlineAfter(std::chrono::milliseconds(20))));
  }
  if (waited.code() == StatusCode::kTimeout) {
    // Stopped or past the deadline: the copies issued cannot be recalled; wait them out.
    waited = (*event)->Wait(DeadlineAfter(kCopyWait));
    if (!waited.ok()) {
      return Status::Internal("device copies still ran " + std::to_string(kCopyWait.count()) +
                              " s after their batch stopped: " + waited.ToString());
    }
    streams.Give(std::move(stream));
    return batch.ShouldStop() ? batch.StopStatus()
                              : Status::Timeout("the batch's deadline passed during device copies");
  }
  if (!waited.ok()) return waited;  // a failed copy: the stream is unusable, dropped
  streams.Give(std::move(stream));
  if (!issued.ok()) return issued;
  // The exporter may have freed its memory as it exited: bytes copied then are not trusted.
  KVFERRY_RETURN_IF_ERROR(alive());
  *bytes += total;
  return Status::Ok();
}

}  // namespace kvferry
