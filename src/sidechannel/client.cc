#include "sidechannel/client.h"

#include <thread>

#include "common/clock.h"
#include "sidechannel/auth.h"

namespace kvferry::sidechannel {

Result<ZmqSocket> Client::Acquire(const std::string& endpoint) {
  {
    MutexLock lock(mu_);
    auto it = idle_.find(endpoint);
    if (it != idle_.end() && !it->second.sockets.empty()) {
      ZmqSocket s = std::move(it->second.sockets.back());
      it->second.sockets.pop_back();
      if (it->second.sockets.empty()) idle_.erase(it);
      return s;
    }
  }
  ZmqSocket s(ZMQ_DEALER);
  if (!s.valid()) return Status::Internal("zmq_socket(DEALER): " + ZmqError());
  // Queue nothing for a peer that is not connected: a send then waits for the connection and
  // fails after the send timeout instead of sitting in a queue.
  KVFERRY_RETURN_IF_ERROR(s.SetInt(ZMQ_IMMEDIATE, 1));
  KVFERRY_RETURN_IF_ERROR(s.SetInt64(ZMQ_MAXMSGSIZE, kMaxFrameBytes));
  KVFERRY_RETURN_IF_ERROR(s.SetInt(ZMQ_RECONNECT_IVL, 100));
  if (endpoint.find('[') != std::string::npos) KVFERRY_RETURN_IF_ERROR(s.SetInt(ZMQ_IPV6, 1));
  if (zmq_connect(s.get(), endpoint.c_str()) != 0) {
    return Status::InvalidArgument("cannot connect to side-channel endpoint '" + endpoint +
                                   "': " + ZmqError());
  }
  return s;
}

void Client::Return(const std::string& endpoint, ZmqSocket socket) {
  std::vector<ZmqSocket> closing;  // closed after the lock is released
  MutexLock lock(mu_);
  auto it = idle_.find(endpoint);
  if (it == idle_.end()) {
    if (options_.max_idle_endpoints == 0) return;
    if (idle_.size() >= options_.max_idle_endpoints) {
      auto lru = idle_.begin();
      for (auto p = idle_.begin(); p != idle_.end(); ++p) {
        if (p->second.last_used < lru->second.last_used) lru = p;
      }
      closing = std::move(lru->second.sockets);
      idle_.erase(lru);
    }
    it = idle_.emplace(endpoint, Pool{}).first;
  }
  it->second.last_used = ++use_clock_;
  if (it->second.sockets.size() < options_.max_idle_sockets_per_endpoint) {
    it->second.sockets.push_back(std::move(socket));
  }
}

Result<wire::Message> Client::Call(const std::string& endpoint, const wire::Message& request,
                                   Deadline deadline) {
  calls_.fetch_add(1);
  const std::vector<std::uint8_t> body = wire::Encode(request);
  Status last = Status::Timeout("no attempt to reach " + endpoint + " fit before the deadline");
  std::chrono::milliseconds backoff = options_.backoff;
  for (int attempt = 0; attempt < std::max(options_.max_attempts, 1); ++attempt) {
    if (attempt > 0) {
      retries_.fetch_add(1);
      if (Clock::now() + backoff >= deadline) break;
      std::this_thread::sleep_for(backoff);
      backoff *= 2;
    }
    const int timeout_ms =
        PollTimeoutMs(deadline, static_cast<int>(options_.attempt_timeout.count()));
    if (timeout_ms <= 0) break;
    Result<ZmqSocket> socket = Acquire(endpoint);
    if (!socket.ok()) {
      failures_.fetch_add(1);
      return socket.status();
    }
    KVFERRY_RETURN_IF_ERROR(socket->SetInt(ZMQ_SNDTIMEO, timeout_ms));
    AuthNonce nonce{};
    const std::vector<std::uint8_t> header =
        SignMessage(options_.secret, AuthKind::kRequest, body, AuthNonce{}, &nonce);
    const auto sent_at = Clock::now();
    Status s = SendFrames(socket->get(), {header, body});
    if (!s.ok()) {
      last = Status::Unavailable("side-channel peer " + endpoint +
                                 " is unreachable: " + std::string(s.message()));
      continue;  // the socket is dropped: its connection state is unknown
    }
    const int left =
        timeout_ms -
        static_cast<int>(
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - sent_at).count());
    KVFERRY_RETURN_IF_ERROR(socket->SetInt(ZMQ_RCVTIMEO, std::max(left, 1)));
    std::vector<std::vector<std::uint8_t>> frames;
    bool truncated = false;
    s = RecvFrames(socket->get(), &frames, 2, wire::kMaxMessageBytes, &truncated);
    if (!s.ok()) {
      // A late reply must never be read as the answer to a later call: drop the socket.
      last = Status::Timeout("side-channel peer " + endpoint + " did not answer within " +
                             std::to_string(timeout_ms) + " ms");
      continue;
    }
    if (truncated || frames.size() != 2) {
      failures_.fetch_add(1);
      return Status::Internal("side-channel peer " + endpoint + " sent a malformed reply");
    }
    Result<AuthHeader> auth = VerifyMessage(options_.secret, AuthKind::kReply, frames[0], frames[1],
                                            nonce, options_.max_clock_skew);
    if (!auth.ok()) {
      failures_.fetch_add(1);
      return auth.status().WithContext("reply from " + endpoint);
    }
    Result<wire::Message> reply = wire::Decode(frames[1]);
    if (!reply.ok()) {
      failures_.fetch_add(1);
      return reply.status().WithContext("reply from " + endpoint);
    }
    Return(endpoint, std::move(socket).value());
    if (const auto* err = std::get_if<wire::ErrorReply>(&*reply)) {
      failures_.fetch_add(1);
      return Status(err->code, "peer " + endpoint + " refused the request: " + err->message);
    }
    return reply;
  }
  failures_.fetch_add(1);
  return last;
}

ClientStats Client::Stats() {
  ClientStats s{calls_.load(), retries_.load(), failures_.load(), 0, 0};
  MutexLock lock(mu_);
  s.idle_endpoints = idle_.size();
  for (const auto& [endpoint, pool] : idle_) s.idle_sockets += pool.sockets.size();
  return s;
}

}  // namespace kvferry::sidechannel
