#include "sidechannel/zmq_util.h"

#include <arpa/inet.h>

#include <cerrno>
#include <cstring>

namespace kvferry::sidechannel {

void* ZmqContext() {
  static void* const context = [] {
    void* c = zmq_ctx_new();
    zmq_ctx_set(c, ZMQ_BLOCKY, 0);  // sockets close without waiting for unsent messages
    return c;
  }();
  return context;
}

std::string ZmqError() { return zmq_strerror(zmq_errno()); }

ZmqSocket::ZmqSocket(int type) : socket_(zmq_socket(ZmqContext(), type)) {
  if (socket_ != nullptr) {
    int linger = 0;
    zmq_setsockopt(socket_, ZMQ_LINGER, &linger, sizeof(linger));
  }
}

ZmqSocket& ZmqSocket::operator=(ZmqSocket&& other) noexcept {
  if (this != &other) {
    if (socket_ != nullptr) zmq_close(socket_);
    socket_ = other.socket_;
    other.socket_ = nullptr;
  }
  return *this;
}

ZmqSocket::~ZmqSocket() {
  if (socket_ != nullptr) zmq_close(socket_);
}

Status ZmqSocket::SetInt(int option, int value) {
  if (zmq_setsockopt(socket_, option, &value, sizeof(value)) != 0) {
    return Status::Internal("zmq_setsockopt(" + std::to_string(option) + "): " + ZmqError());
  }
  return Status::Ok();
}

Status ZmqSocket::SetInt64(int option, std::int64_t value) {
  if (zmq_setsockopt(socket_, option, &value, sizeof(value)) != 0) {
    return Status::Internal("zmq_setsockopt(" + std::to_string(option) + "): " + ZmqError());
  }
  return Status::Ok();
}

Status SendFrames(void* socket, const std::vector<std::span<const std::uint8_t>>& frames) {
  for (std::size_t i = 0; i < frames.size(); ++i) {
    const int flags = i + 1 < frames.size() ? ZMQ_SNDMORE : 0;
    if (zmq_send(socket, frames[i].data(), frames[i].size(), flags) < 0) {
      if (zmq_errno() == EAGAIN) {
        return Status::Unavailable(
            "the peer did not accept the message in time: it is not "
            "listening or not reachable");
      }
      return Status::Unavailable("zmq_send: " + ZmqError());
    }
  }
  return Status::Ok();
}

Status RecvFrames(void* socket, std::vector<std::vector<std::uint8_t>>* frames,
                  std::size_t max_frames, std::size_t max_frame_bytes, bool* truncated) {
  frames->clear();
  *truncated = false;
  for (;;) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, socket, 0) < 0) {
      const int err = zmq_errno();
      zmq_msg_close(&msg);
      if (err == EAGAIN) return Status::Timeout("no reply within the receive timeout");
      return Status::Unavailable("zmq_msg_recv: " + std::string(zmq_strerror(err)));
    }
    const bool more = zmq_msg_more(&msg) != 0;
    const std::size_t size = zmq_msg_size(&msg);
    if (frames->size() < max_frames && size <= max_frame_bytes) {
      const auto* p = static_cast<const std::uint8_t*>(zmq_msg_data(&msg));
      frames->emplace_back(p, p + size);
    } else {
      *truncated = true;
    }
    zmq_msg_close(&msg);
    if (!more) return Status::Ok();
  }
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost") return true;
  unsigned char buf[16];
  if (inet_pton(AF_INET, host.c_str(), buf) == 1) return buf[0] == 127;
  if (inet_pton(AF_INET6, host.c_str(), buf) == 1) return host == "::1";
  return false;
}

std::string BracketedHost(const std::string& host) {
  return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

}  // namespace kvferry::sidechannel
