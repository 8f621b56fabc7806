// One job, over 450 lines and kept whole: one client connection's thread (tcp_client.h). Sending,
// receiving (straight or staged), dropping a connection to abandon a stopped batch, retries and
// reconnects all work on the same thread-only state (the socket, the pipeline, the staging), so
// splitting them would spread one state machine over files.
#include "transport/tcp/tcp_client.h"

#include <pthread.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/clock.h"
#include "transport/tcp/frames.h"
#include "transport/tcp/send_stage.h"

namespace kvferry::tcp {
namespace {

constexpr int kPipelineDepth = 4;  // requests in flight per connection
constexpr int kMaxAttempts = 2;    // a request survives one broken connection
constexpr std::string_view kAbandon = "connection dropped to abandon a stopped batch";

constexpr std::uint64_t kStageBytes = std::uint64_t{2} << 20;  // per staging buffer

// True when the server closed (or reset) an idle connection: it has nothing to say otherwise.
bool ClosedByPeer(int fd) {
  std::uint8_t byte = 0;
  const ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return true;
  return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

}  // namespace

Status Handshake(int fd, const TcpEndpoint& peer, const std::string& secret, Deadline deadline,
                 const StopCheck& also_stop) {
  const StopCheck stop = [deadline, &also_stop]() -> Status {
    if (Expired(deadline)) return Status::Timeout("the tcp handshake did not finish in time");
    if (also_stop) return also_stop();
    return Status::Ok();
  };
  const std::string where = peer.host + ":" + std::to_string(peer.port);
  std::uint8_t hello[kHelloBytes];
  iovec iov{hello, sizeof(hello)};
  std::uint64_t got = 0;
  Status s = RecvAll(fd, &iov, 1, stop, &got);
  if (!s.ok()) return s.WithContext("waiting for the tcp server's hello from " + where);
  if (GetU32(hello) != kHelloMagic || GetU32(hello + 4) != kVersion) {
    return Status::NotSupported(
        "the tcp server at " + where + " does not speak kvferry tcp v1 (hello magic " +
        std::to_string(GetU32(hello)) + ", version " + std::to_string(GetU32(hello + 4)) + ")");
  }
  Nonce server{};
  std::memcpy(server.data(), hello + 8, kNonceBytes);
  const Nonce client = RandomNonce();
  std::uint8_t auth[kAuthBytes];
  PutU32(auth, kAuthMagic);
  PutU32(auth + 4, kVersion);
  std::memcpy(auth + 8, client.data(), kNonceBytes);
  const Sha256Digest mac = ClientMac(secret, server, client);
  std::memcpy(auth + 8 + kNonceBytes, mac.data(), mac.size());
  iovec out{auth, sizeof(auth)};
  s = SendAll(fd, &out, 1, stop);
  if (!s.ok()) return s.WithContext("sending the tcp handshake to " + where);
  std::uint8_t result[kResultBytes];
  iovec in{result, sizeof(result)};
  s = RecvAll(fd, &in, 1, stop, &got);
  if (!s.ok()) return s.WithContext("waiting for the tcp handshake result from " + where);
  if (GetU32(result) != kResultMagic) {
    return Status::Internal("the tcp server at " + where +
                            " answered the handshake with a malformed result frame");
  }
  const std::uint32_t code = GetU32(result + 4);
  if (code == static_cast<std::uint32_t>(StatusCode::kUnauthenticated)) {
    return Status::Unauthenticated(
        "the peer's tcp server refused this client: the shared secrets differ (set the same "
        "secret on both sides; without one, only loopback clients are served)");
  }
  if (code != 0) {
    return Status(StatusCodeFromWire(code),
                  "the tcp server at " + where + " refused the handshake (status " +
                      std::string(StatusCodeName(StatusCodeFromWire(code))) + ")");
  }
  Sha256Digest proof{};
  std::memcpy(proof.data(), result + 8, proof.size());
  if (!DigestEquals(proof, ServerMac(secret, server, client, peer.instance))) {
    // It accepted our proof of the secret, so it holds it: it is another server instance.
    return Status::PeerDisconnected(
        "the tcp server at " + where +
        " is not the one this peer's descriptor names (it restarted, or another process took the "
        "port); its memory is not this peer's: connect again with its current descriptor");
  }
  return Status::Ok();
}

ClientConnection::ClientConnection(TcpEndpoint endpoint, const ClientOptions& options, Fd fd,
                                   std::atomic<std::uint64_t>* staging_gauge)
    : endpoint_(std::move(endpoint)),
      options_(options),
      fd_(std::move(fd)),
      staging_gauge_(staging_gauge) {
  thread_ = std::thread([this] { Run(); });
  pthread_setname_np(thread_.native_handle(), "kvferry-tcpcli");
}

ClientConnection::~ClientConnection() {
  {
    MutexLock lock(mu_);
    shutting_down_ = true;
  }
  cv_.SignalAll();
  thread_.join();
  for (auto& [dev, staging] : staging_) {
    for (StageSlot& slot : staging.slots) {
      if (slot.buffer) staging_gauge_->fetch_sub(slot.buffer->size());
    }
  }
}

void ClientConnection::Enqueue(Request r) {
  {
    MutexLock lock(mu_);
    if (!shutting_down_) {
      queue_.push_back(std::move(r));
      cv_.SignalAll();
      return;
    }
  }
  r.batch->UnitDone(Disconnected(), 0);
}

std::size_t ClientConnection::Load() {
  MutexLock lock(mu_);
  return queue_.size() + in_flight_.size();
}

void ClientConnection::Run() {
  for (;;) {
    {
      MutexLock lock(mu_);
      while (!shutting_down_ && queue_.empty() && in_flight_.empty()) cv_.Wait(mu_);
      if (shutting_down_) break;
    }
    Step();
  }
  // Everything still here ends now, so that its batches can end.
  std::deque<Request> rest;
  {
    MutexLock lock(mu_);
    rest.swap(queue_);
    for (Request& r : in_flight_) rest.push_back(std::move(r));
    in_flight_.clear();
  }
  for (Request& r : rest) r.batch->UnitDone(Disconnected(), 0);
}

void ClientConnection::Step() {
  // The server closes connections idle for longer than its idle timeout; notice that before
  // sending, so an idle close costs a reconnect, not a request's retry.
  if (fd_.valid() && sent_ids_.empty() && ClosedByPeer(fd_.get())) fd_.Reset();
  if (!fd_.valid()) {
    Status s = Reconnect();
    if (!s.ok()) {
      // Nothing was left to reconnect for: requests queued since then wait for the next Step,
      // which reconnects for them; failing them with this status would fail healthy batches.
      if (s.code() == StatusCode::kCancelled) return;
      FailAll(s);
      return;
    }
  }
  for (;;) {
    Request r;
    {
      MutexLock lock(mu_);
      if (queue_.empty() || in_flight_.size() >= kPipelineDepth) break;
      r = std::move(queue_.front());
      queue_.pop_front();
    }
    if (r.batch->ShouldStop()) {
      r.batch->UnitDone(r.batch->StopStatus(), 0);
      continue;
    }
    Status s = Send(r);
    // Kept alive by the request in in_flight_, which only this thread takes out.
    Batch* const batch = r.batch.get();
    {
      MutexLock lock(mu_);
      in_flight_.push_back(std::move(r));
    }
    if (!s.ok()) {
      // A request whose own batch stopped mid-send is not the connection's fault: the others
      // are retried without counting an attempt.
      const bool own = batch->ShouldStop();
      Broken(own ? Status::Cancelled(std::string(kAbandon)) : s);
      return;
    }
  }
  Request current;
  {
    MutexLock lock(mu_);
    if (in_flight_.empty()) return;
    current = std::move(in_flight_.front());
    in_flight_.pop_front();
  }
  std::uint64_t received = 0;
  Status s = Receive(current, &received);
  if (s.ok()) {
    current.batch->UnitDone(Status::Ok(), received);
    return;
  }
  if (current.batch->ShouldStop()) {
    // Its batch was cancelled, failed elsewhere or timed out, mid-response. The rest of the
    // response must not land in memory the caller may now reuse: drop the connection.
    current.batch->UnitDone(current.batch->StopStatus(), received);
    Broken(Status::Cancelled(std::string(kAbandon)));
    return;
  }
  if (s.code() == StatusCode::kPeerDisconnected ||
      (s.code() == StatusCode::kCancelled && s.message() == kAbandon)) {
    {
      MutexLock lock(mu_);
      in_flight_.push_front(std::move(current));
    }
    Broken(s);
    return;
  }
  // The server refused the read (an error response) or sent a malformed frame.
  current.batch->UnitDone(s, received);
  if (s.code() == StatusCode::kInternal) Broken(s);
}

Status ClientConnection::Send(Request& r) {
  std::vector<std::uint8_t> frame(kRequestHeaderBytes + r.ops.size() * kOpBytes);
  const std::uint64_t id = next_id_++;
  EncodeRequestHeader({static_cast<std::uint32_t>(r.ops.size()), id}, frame.data());
  for (std::size_t i = 0; i < r.ops.size(); ++i) {
    EncodeOp({r.ops[i].remote_region, r.ops[i].remote_offset, r.ops[i].length},
             frame.data() + kRequestHeaderBytes + i * kOpBytes);
  }
  sent_ids_.push_back(id);
  iovec iov{frame.data(), frame.size()};
  const Deadline deadline = r.batch->deadline();
  return SendAll(fd_.get(), &iov, 1, [&]() -> Status {
    if (ShuttingDown()) return Disconnected();
    // A cancelled batch must not wait for a slow peer to take its request.
    if (r.batch->ShouldStop()) return r.batch->StopStatus();
    if (Expired(deadline)) return Status::Timeout("sending a read request timed out");
    return Status::Ok();
  });
}

Status ClientConnection::Receive(Request& r, std::uint64_t* received) {
  const std::uint64_t want_id = sent_ids_.front();
  sent_ids_.pop_front();
  const StopCheck stop = [&]() -> Status {
    if (ShuttingDown()) return Disconnected();
    if (r.batch->ShouldStop()) return r.batch->StopStatus();
    // A stopped batch queued or pipelined behind this response must not wait for it.
    if (SweepStopped()) return Status::Cancelled(std::string(kAbandon));
    return Status::Ok();
  };
  std::uint8_t head[kResponseHeaderBytes];
  iovec hv{head, sizeof(head)};
  std::uint64_t header_bytes = 0;
  KVFERRY_RETURN_IF_ERROR(RecvAll(fd_.get(), &hv, 1, stop, &header_bytes));
  Result<ResponseHeader> h =
      ParseResponseHeader(std::span<const std::uint8_t, kResponseHeaderBytes>(head));
  if (!h.ok() || h->request_id != want_id) {
    return Status::Internal(
        "the peer's tcp server sent a malformed response; dropping the "
        "connection");
  }
  if (h->status != 0) {
    std::string text(h->payload_length, '\0');
    iovec tv{text.data(), text.size()};
    std::uint64_t n = 0;
    KVFERRY_RETURN_IF_ERROR(RecvAll(fd_.get(), &tv, 1, stop, &n));
    return Status(StatusCodeFromWire(h->status), "the peer refused the read: " + text);
  }
  if (h->payload_length != r.bytes) {
    return Status::Internal("the peer's tcp server answered with " +
                            std::to_string(h->payload_length) + " bytes, expected " +
                            std::to_string(r.bytes));
  }
  if (!r.devices.empty()) return ReceiveStaged(r, stop, received);
  std::vector<iovec> iov;
  iov.reserve(r.ops.size());
  for (const ReadOp& op : r.ops) iov.push_back({op.local, op.length});
  return RecvAll(fd_.get(), iov.data(), static_cast<int>(iov.size()), stop, received);
}

Status ClientConnection::ReceiveStaged(Request& r, const StopCheck& stop, std::uint64_t* received) {
  Status result;
  std::size_t i = 0;
  std::uint64_t op_off = 0;  // bytes of op i already received
  while (i < r.ops.size() && result.ok()) {
    device::Device* dev = r.devices[i];
    if (dev == nullptr) {
      iovec v{r.ops[i].local, r.ops[i].length};
      result = RecvAll(fd_.get(), &v, 1, stop, received);
      ++i;
      continue;
    }
    Result<Staging*> got = StagingFor(*dev);
    if (!got.ok()) {
      result = Status::Internal("staging for " + dev->name() +
                                " memory failed: " + got.status().ToString());
      break;
    }
    Staging& st = **got;
    StageSlot& slot = st.slots[st.next];
    st.next ^= 1;
    if (Status w = WaitSlot(slot); !w.ok()) {
      result = w;
      break;
    }
    // One buffer's worth of the payload: consecutive ops on this device, the last maybe cut.
    struct Piece {
      std::byte* dst;
      std::uint64_t at;
      std::uint64_t len;
    };
    std::vector<Piece> pieces;
    std::uint64_t total = 0;
    while (i < r.ops.size() && r.devices[i] == dev && total < kStageBytes) {
      const ReadOp& op = r.ops[i];
      const std::uint64_t len = std::min(kStageBytes - total, op.length - op_off);
      pieces.push_back({op.local + op_off, total, len});
      total += len;
      op_off += len;
      if (op_off < op.length) break;
      ++i;
      op_off = 0;
    }
    iovec v{slot.buffer->data(), total};
    result = RecvAll(fd_.get(), &v, 1, stop, received);
    if (!result.ok()) break;
    Status copy;
    for (const Piece& p : pieces) {
      copy = st.stream->CopyHostToDevice(reinterpret_cast<device::DeviceAddress>(p.dst),
                                         slot.buffer->data() + p.at, p.len);
      if (!copy.ok()) break;
    }
    // Recorded even after a failed copy, so that the copies issued are waited for below.
    Result<std::unique_ptr<device::Event>> event = st.stream->RecordEvent();
    if (event.ok()) slot.event = std::move(event).value();
    if (!copy.ok() || !event.ok()) {
      result = Status::Internal("copying received bytes to " + dev->name() +
                                " failed: " + (copy.ok() ? event.status() : copy).ToString());
    }
  }
  for (auto& [dev, staging] : staging_) {
    for (StageSlot& slot : staging.slots) {
      if (Status w = WaitSlot(slot); !w.ok() && result.ok()) result = w;
    }
  }
  return result;
}

Result<ClientConnection::Staging*> ClientConnection::StagingFor(device::Device& dev) {
  Staging& st = staging_[&dev];
  if (!st.stream) {
    KVFERRY_ASSIGN_OR_RETURN(st.stream, dev.CreateStream());
  }
  for (StageSlot& slot : st.slots) {
    if (!slot.buffer) {
      KVFERRY_ASSIGN_OR_RETURN(slot.buffer, dev.AllocatePinned(kStageBytes));
      staging_gauge_->fetch_add(slot.buffer->size());
    }
  }
  return &st;
}

Status ClientConnection::WaitSlot(StageSlot& slot) {
  if (!slot.event) return Status::Ok();
  Status s = slot.event->Wait(DeadlineAfter(kCopyWait));
  slot.event.reset();
  if (!s.ok()) return Status::Internal("a staged copy to device memory failed: " + s.ToString());
  return s;
}

bool ClientConnection::SweepStopped() {
  std::vector<Request> stopped;
  bool pipelined = false;
  {
    MutexLock lock(mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->batch->ShouldStop()) {
        stopped.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    for (const Request& r : in_flight_) pipelined = pipelined || r.batch->ShouldStop();
  }
  for (Request& r : stopped) r.batch->UnitDone(r.batch->StopStatus(), 0);
  return pipelined;
}

void ClientConnection::Broken(const Status& why) {
  const bool abandon = why.code() == StatusCode::kCancelled;
  fd_.Reset();
  sent_ids_.clear();
  std::deque<Request> retry;
  {
    MutexLock lock(mu_);
    retry.swap(in_flight_);
  }
  for (auto it = retry.rbegin(); it != retry.rend(); ++it) {
    Request& r = *it;
    if (r.batch->ShouldStop()) {
      r.batch->UnitDone(r.batch->StopStatus(), 0);
    } else if (!abandon && ++r.attempts >= kMaxAttempts) {
      r.batch->UnitDone(why.code() == StatusCode::kCancelled
                            ? Status::PeerDisconnected("the connection to the peer broke")
                            : why,
                        0);
    } else {
      MutexLock lock(mu_);
      queue_.push_front(std::move(r));
    }
  }
}

Status ClientConnection::Reconnect() {
  Deadline deadline = DeadlineAfter(std::chrono::milliseconds(2000));
  {
    MutexLock lock(mu_);
    for (const Request& r : queue_) deadline = std::min(deadline, r.batch->deadline());
  }
  const StopCheck stop = [this]() -> Status {
    if (ShuttingDown()) return Disconnected();
    SweepStopped();
    MutexLock lock(mu_);
    if (queue_.empty()) return Status::Cancelled("no request is left to reconnect for");
    return Status::Ok();
  };
  Result<Fd> fd =
      tcp::Connect(endpoint_.host, endpoint_.port, deadline, options_.user_timeout, stop);
  if (!fd.ok()) {
    if (fd.status().code() == StatusCode::kCancelled) return fd.status();
    return Status::PeerDisconnected(
        "lost the connection to " + endpoint_.host + ":" + std::to_string(endpoint_.port) +
        " and could not reconnect: " + std::string(fd.status().message()));
  }
  KVFERRY_RETURN_IF_ERROR(Handshake(fd->get(), endpoint_, options_.secret, deadline, stop));
  fd_ = std::move(fd).value();
  return Status::Ok();
}

void ClientConnection::FailAll(const Status& s) {
  std::deque<Request> all;
  {
    MutexLock lock(mu_);
    all.swap(queue_);
  }
  for (Request& r : all) r.batch->UnitDone(r.batch->ShouldStop() ? r.batch->StopStatus() : s, 0);
}

Status ClientConnection::Disconnected() {
  return Status::PeerDisconnected("the tcp peer was disconnected");
}

bool ClientConnection::ShuttingDown() {
  MutexLock lock(mu_);
  return shutting_down_;
}

}  // namespace kvferry::tcp
