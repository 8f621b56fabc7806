#include "sidechannel/listener.h"

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/errno_text.h"
#include "common/log.h"

namespace kvferry::sidechannel {
int ListenerPort(const ListenerOptions& o) {
  const std::int64_t port =
      o.base_port + (static_cast<std::int64_t>(o.dp_rank) * o.pp_size + o.pp_rank) * o.tp_size +
      o.tp_rank;
  return port > 65535 ? -1 : static_cast<int>(port);
}

Result<std::unique_ptr<Listener>> Listener::Start(const ListenerOptions& options,
                                                  RequestHandler handler) {
  if (options.secret.empty() && !options.allow_insecure_remote &&
      !IsLoopbackHost(options.bind_host)) {
    return Status::InvalidArgument(
        "the side channel would listen on " + options.bind_host +
        " without a shared secret, so anyone who reaches the port could release blocks; set a "
        "secret (KVFERRY_SECRET), bind to 127.0.0.1, or allow this explicitly");
  }
  if (options.tp_size < 1 || options.tp_rank < 0 || options.tp_rank >= options.tp_size ||
      options.dp_rank < 0 || options.pp_size < 1 || options.pp_rank < 0 ||
      options.pp_rank >= options.pp_size || options.dp_rank > 65535 || options.pp_size > 65535 ||
      options.tp_size > 65535) {
    return Status::InvalidArgument(
        "listener placement dp " + std::to_string(options.dp_rank) + ", pp " +
        std::to_string(options.pp_rank) + " of " + std::to_string(options.pp_size) + ", tp " +
        std::to_string(options.tp_rank) + " of " + std::to_string(options.tp_size) + " is invalid");
  }
  const int port = ListenerPort(options);
  if (port <= 0 || port > 65535) {
    return Status::InvalidArgument(
        "listener port of dp " + std::to_string(options.dp_rank) + ", pp " +
        std::to_string(options.pp_rank) + ", tp " + std::to_string(options.tp_rank) +
        " (base port + (dp_rank * pp_size + pp_rank) * tp_size + tp_rank) is outside 1..65535");
  }
  ZmqSocket router(ZMQ_ROUTER);
  if (!router.valid()) return Status::Internal("zmq_socket(ROUTER): " + ZmqError());
  static_assert(kMaxFrameBytes == wire::kMaxMessageBytes + kAuthHeaderBytes);
  // ZeroMQ drops a peer that announces a larger frame before buffering it (docs/protocol.md).
  KVFERRY_RETURN_IF_ERROR(router.SetInt64(ZMQ_MAXMSGSIZE, kMaxFrameBytes));
  KVFERRY_RETURN_IF_ERROR(router.SetInt(ZMQ_SNDTIMEO, 0));  // never block on a peer
  if (options.bind_host.find(':') != std::string::npos) {
    KVFERRY_RETURN_IF_ERROR(router.SetInt(ZMQ_IPV6, 1));
  }
  const std::string endpoint =
      "tcp://" + BracketedHost(options.bind_host) + ":" + std::to_string(port);
  if (zmq_bind(router.get(), endpoint.c_str()) != 0) {
    const int err = zmq_errno();
    return Status::Unavailable(
        "cannot listen on " + endpoint + ": " + zmq_strerror(err) +
        (err == EADDRINUSE
             ? "; port " + std::to_string(port) + " (DP rank " + std::to_string(options.dp_rank) +
                   ", pipeline stage " + std::to_string(options.pp_rank) + " of " +
                   std::to_string(options.pp_size) + ", TP rank " +
                   std::to_string(options.tp_rank) + " of " + std::to_string(options.tp_size) +
                   ") is in use: choose another base port (kv_connector_extra_config "
                   "base_port, or VLLM_ASCEND_LLMDD_RPC_PORT); with pipeline parallelism each "
                   "stage needs its own TP-size block of ports, so tell kvferry the PP size"
             : ""));
  }
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake < 0) return Status::Internal(std::string("eventfd: ") + ErrnoText(errno));
  return std::unique_ptr<Listener>(
      new Listener(options, std::move(handler), std::move(router), wake, endpoint));
}

Listener::Listener(ListenerOptions options, RequestHandler handler, ZmqSocket router, int wake,
                   std::string endpoint)
    : options_(std::move(options)),
      handler_(std::move(handler)),
      router_(std::move(router)),
      wake_(wake),
      endpoint_(std::move(endpoint)),
      replay_(options_.max_clock_skew, 1u << 20),
      handlers_(std::make_unique<WorkQueue>(1, "kvferry-schandle")) {
  thread_ = std::thread([this] { Run(); });
  pthread_setname_np(thread_.native_handle(), "kvferry-sclisten");
}

Listener::~Listener() {
  stopping_.store(true);
  const std::uint64_t one = 1;
  (void)!write(wake_, &one, sizeof(one));
  thread_.join();
  handlers_.reset();  // runs or finishes the handlers still queued
  close(wake_);
}

ListenerStats Listener::Stats() const {
  return {handled_.load(), malformed_.load(), oversized_.load(), unauthenticated_.load(),
          overloaded_.load()};
}

void Listener::Run() {
  for (;;) {
    zmq_pollitem_t items[2] = {{router_.get(), 0, ZMQ_POLLIN, 0}, {nullptr, wake_, ZMQ_POLLIN, 0}};
    if (zmq_poll(items, 2, -1) < 0) {
      if (zmq_errno() == EINTR) continue;
      Log().error("side-channel listener: zmq_poll failed: {}; retrying", ZmqError());
      continue;
    }
    if ((items[1].revents & ZMQ_POLLIN) != 0) {
      std::uint64_t n = 0;
      (void)!read(wake_, &n, sizeof(n));
      if (stopping_.load()) return;
      std::deque<Outgoing> out;
      {
        MutexLock lock(out_mu_);
        out.swap(outbox_);
      }
      for (const Outgoing& o : out) Send(o);
    }
    if ((items[0].revents & ZMQ_POLLIN) != 0) {
      // Drain what is ready, but come back to the outbox regularly.
      for (int i = 0; i < 64; ++i) {
        int events = 0;
        std::size_t len = sizeof(events);
        zmq_getsockopt(router_.get(), ZMQ_EVENTS, &events, &len);
        if ((events & ZMQ_POLLIN) == 0) break;
        HandleIncoming();
      }
    }
  }
}

void Listener::HandleIncoming() {
  std::vector<std::vector<std::uint8_t>> frames;
  bool truncated = false;
  Status s = RecvFrames(router_.get(), &frames, 3, wire::kMaxMessageBytes, &truncated);
  if (!s.ok() || frames.empty()) return;  // nothing to answer: no identity
  const std::vector<std::uint8_t> identity = frames[0];
  // Refusals are bound to the request's nonce whenever its header is well-formed, so that its
  // sender can verify them and read why (a skewed clock, a wrong secret); else to zeros.
  const AuthNonce no_nonce =
      frames.size() >= 2 ? RequestNonceOf(frames[1]).value_or(AuthNonce{}) : AuthNonce{};
  if (truncated) {
    Refuse(identity, no_nonce,
           Status::ResourceExhausted("message has more frames or bytes than allowed (" +
                                     std::to_string(wire::kMaxMessageBytes) + " bytes)"),
           &oversized_);
    return;
  }
  if (frames.size() != 3) {
    Refuse(identity, no_nonce,
           Status::InvalidArgument("expected two frames, [authentication header][message]; found " +
                                   std::to_string(frames.size() - 1)),
           &malformed_);
    return;
  }
  Result<AuthHeader> auth = VerifyMessage(options_.secret, AuthKind::kRequest, frames[1], frames[2],
                                          no_nonce, options_.max_clock_skew);
  if (!auth.ok()) {
    Refuse(identity, no_nonce, auth.status(), &unauthenticated_);
    return;
  }
  if (!replay_.Accept(*auth)) {
    Refuse(identity, auth->nonce,
           Status::Unauthenticated(
               "replayed message: this nonce was already accepted (under this or another "
               "timestamp), or the replay guard is full and the message is not newer than the "
               "newest nonce it had to forget; send a fresh message with a new nonce"),
           &unauthenticated_);
    return;
  }
  Result<wire::Message> msg = wire::Decode(frames[2]);
  if (!msg.ok()) {
    Refuse(identity, auth->nonce, msg.status(), &malformed_);
    return;
  }
  const bool is_request = std::holds_alternative<wire::MetadataRequest>(*msg) ||
                          std::holds_alternative<wire::FinishedNotice>(*msg) ||
                          std::holds_alternative<wire::AbortNotice>(*msg) ||
                          std::holds_alternative<wire::LeaseRenewal>(*msg) ||
                          std::holds_alternative<wire::Subscribe>(*msg) ||
                          std::holds_alternative<wire::Progress>(*msg);
  if (!is_request) {
    Refuse(identity, auth->nonce,
           Status::InvalidArgument(std::string("a listener does not accept '") +
                                   wire::MessageTypeName(*msg) + "' messages"),
           &malformed_);
    return;
  }
  if (pending_.load() >= options_.max_pending) {
    Refuse(identity, auth->nonce,
           Status::ResourceExhausted("listener is overloaded; retry shortly"), &overloaded_);
    return;
  }
  pending_.fetch_add(1);
  handlers_->Post([this, identity, nonce = auth->nonce, request = std::move(msg).value()] {
    wire::Message reply = handler_(request);
    std::vector<std::uint8_t> body = wire::Encode(reply);
    std::vector<std::uint8_t> header =
        SignMessage(options_.secret, AuthKind::kReply, body, nonce, nullptr);
    handled_.fetch_add(1);
    pending_.fetch_sub(1);
    Post({identity, std::move(header), std::move(body)});
  });
}

void Listener::Refuse(const std::vector<std::uint8_t>& identity, const AuthNonce& nonce,
                      const Status& status, std::atomic<std::uint64_t>* counter) {
  counter->fetch_add(1);
  if (const std::uint64_t n = log_limit_.Hit(); n != 0) {
    Log().warn("side-channel listener {}: refused message #{}: {}", endpoint_, n,
               status.ToString());
  }
  const std::vector<std::uint8_t> body = wire::Encode(wire::ErrorReply{
      status.code(), std::string(status.message().substr(0, wire::kMaxTextBytes))});
  Send({identity, SignMessage(options_.secret, AuthKind::kReply, body, nonce, nullptr), body});
}

void Listener::Send(const Outgoing& out) {
  // A peer that went away, or whose queue is full, loses its reply; it will time out and retry.
  (void)SendFrames(router_.get(), {out.identity, out.header, out.body});
}

void Listener::Post(Outgoing out) {
  {
    MutexLock lock(out_mu_);
    outbox_.push_back(std::move(out));
  }
  const std::uint64_t one = 1;
  (void)!write(wake_, &one, sizeof(one));
}

}  // namespace kvferry::sidechannel
