// RAII over libzmq's C API. kvferry uses the C API rather than cppzmq because cppzmq reports
// errors by throwing, and src/ reports errors as Status values.
#pragma once

#include <zmq.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::sidechannel {

/// The one ZeroMQ context of the process, created on first use and never destroyed (so sockets
/// in static objects can still close at exit). Thread-safe.
void* ZmqContext();

/// Owns one socket; closes it (linger 0) on destruction. A socket is used by one thread at a time.
class ZmqSocket {
 public:
  ZmqSocket() = default;
  explicit ZmqSocket(int type);
  ZmqSocket(ZmqSocket&& other) noexcept : socket_(other.socket_) { other.socket_ = nullptr; }
  ZmqSocket& operator=(ZmqSocket&& other) noexcept;
  ZmqSocket(const ZmqSocket&) = delete;
  ZmqSocket& operator=(const ZmqSocket&) = delete;
  ~ZmqSocket();

  void* get() const { return socket_; }
  bool valid() const { return socket_ != nullptr; }
  Status SetInt(int option, int value);
  Status SetInt64(int option, std::int64_t value);

 private:
  void* socket_ = nullptr;
};

/// Sends `frames` as one multipart message. With ZMQ_DONTWAIT semantics decided by the socket's
/// ZMQ_SNDTIMEO. Unavailable if it could not be sent in time.
Status SendFrames(void* socket, const std::vector<std::span<const std::uint8_t>>& frames);

/// Receives one multipart message; at most `max_frames` frames are kept (the rest are read and
/// dropped, and *truncated is set). Timeout when none arrives within the socket's ZMQ_RCVTIMEO.
Status RecvFrames(void* socket, std::vector<std::vector<std::uint8_t>>* frames,
                  std::size_t max_frames, std::size_t max_frame_bytes, bool* truncated);

std::string ZmqError();

/// True for "localhost", 127.0.0.0/8 and ::1: addresses only this host can reach. Listeners
/// without a shared secret bind to these only.
bool IsLoopbackHost(const std::string& host);

/// `host` as it goes into a ZeroMQ tcp endpoint: IPv6 literals in brackets.
std::string BracketedHost(const std::string& host);

}  // namespace kvferry::sidechannel
