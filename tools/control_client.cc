#include "tools/control_client.h"

#include <iostream>

#include "tools/engine_protocol.h"

namespace kvferry::cli {
namespace {

using Json = nlohmann::json;

// Longer than any reply is awaited (the demo's run deadline is 10 minutes).
constexpr std::chrono::minutes kForgetNoncesAfter{15};

}  // namespace

ControlClient::ControlClient(const std::string& endpoint, std::string secret)
    : secret_(std::move(secret)), endpoint_(endpoint), socket_(ZMQ_DEALER) {
  (void)socket_.SetInt(ZMQ_SNDTIMEO, 5000);
  (void)socket_.SetInt64(ZMQ_MAXMSGSIZE, static_cast<std::int64_t>(kMaxControlFrameBytes));
  if (endpoint.find('[') != std::string::npos) (void)socket_.SetInt(ZMQ_IPV6, 1);
  zmq_connect(socket_.get(), endpoint.c_str());
}

Status ControlClient::Send(const Json& request) {
  Prune();
  sidechannel::AuthNonce nonce{};
  const SignedMessage m = SignControlRequest(secret_, request, &nonce);
  outstanding_[nonce] = Clock::now();
  last_sent_ = nonce;
  return sidechannel::SendFrames(socket_.get(), {m.header, m.body});
}

std::optional<Json> ControlClient::TryRecv() {
  for (;;) {
    int events = 0;
    std::size_t len = sizeof(events);
    zmq_getsockopt(socket_.get(), ZMQ_EVENTS, &events, &len);
    if ((events & ZMQ_POLLIN) == 0) return std::nullopt;
    std::vector<std::vector<std::uint8_t>> frames;
    bool truncated = false;
    if (!sidechannel::RecvFrames(socket_.get(), &frames, 2, kMaxControlFrameBytes, &truncated)
             .ok()) {
      return std::nullopt;
    }
    std::string why;
    std::optional<Json> reply;
    if (truncated || frames.size() != 2) {
      why = "expected two frames, [authentication header][JSON]";
    } else {
      Json j = Json::parse(frames[1].begin(), frames[1].end(), nullptr, false);
      const auto it = j.is_object() ? j.find("request_nonce") : j.end();
      const std::optional<sidechannel::AuthNonce> nonce =
          it != j.end() && it->is_string() ? NonceFromHex(it->get_ref<const std::string&>())
                                           : std::nullopt;
      const auto sent = nonce ? outstanding_.find(*nonce) : outstanding_.end();
      if (sent == outstanding_.end()) {
        why = "it answers no request this proxy sent";
      } else {
        Result<sidechannel::AuthHeader> auth =
            sidechannel::VerifyMessage(secret_, sidechannel::AuthKind::kReply, frames[0], frames[1],
                                       *nonce, kControlMaxClockSkew);
        if (auth.ok()) {
          outstanding_.erase(sent);
          reply = std::move(j);
        } else {
          why =
              auth.status().ToString() + " (is KVFERRY_SECRET the same here and at the instance?)";
        }
      }
    }
    if (reply) return reply;
    if (++rejected_ <= 10) {
      std::cerr << "kvferry: dropped a reply from " << endpoint_ << ": " << why << "\n";
    }
  }
}

Result<Json> ControlClient::Call(const Json& request, std::chrono::milliseconds timeout) {
  KVFERRY_RETURN_IF_ERROR(Send(request));
  const sidechannel::AuthNonce nonce = *last_sent_;
  const std::string want = NonceHex(nonce);
  const Deadline deadline = DeadlineAfter(timeout);
  while (!Expired(deadline)) {
    zmq_pollitem_t item{socket_.get(), 0, ZMQ_POLLIN, 0};
    zmq_poll(&item, 1, PollTimeoutMs(deadline, 50));
    while (std::optional<Json> r = TryRecv()) {
      const auto it = r->find("request_nonce");
      if (it != r->end() && *it == want) return *r;
    }
  }
  outstanding_.erase(nonce);
  const auto op = request.find("op");
  return Status::Timeout(
      "instance " + endpoint_ + " did not answer '" +
      (op != request.end() && op->is_string() ? op->get<std::string>() : std::string("?")) +
      "' within " + std::to_string(timeout.count()) + " ms");
}

void ControlClient::Prune() {
  const auto cutoff = Clock::now() - kForgetNoncesAfter;
  for (auto it = outstanding_.begin(); it != outstanding_.end();) {
    it = it->second < cutoff ? outstanding_.erase(it) : std::next(it);
  }
}

}  // namespace kvferry::cli
