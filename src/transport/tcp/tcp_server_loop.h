// What the tcp read server's thread does with its connections (tcp_server.h owns the thread, the
// listening socket and the wakeups): accepting them under the caps, the handshake, parsing and
// checking requests, sending responses from registered memory (device memory through pinned
// staging), deadlines and revocation. One thread only: no locks.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/clock.h"
#include "device/device.h"
#include "transport/region_registry.h"
#include "transport/tcp/frames.h"
#include "transport/tcp/send_stage.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_server.h"

namespace kvferry::tcp {

// The connections of one server and everything done with them, driven by TcpServer::Run.
class ServerLoop {
 public:
  ServerLoop(RegionRegistry* registry, const std::string& secret, std::uint64_t instance,
             ServerCounters* counters, const ServerLimits& limits, int epoll);

  // Accepts every pending connection. Connections past a cap are closed at once; they are never
  // left in the backlog, where they would keep the listener readable and the loop spinning.
  // Returns false when accepting must pause (out of descriptors even after the reserve one was
  // given up); the caller stops watching the listener until the next sweep.
  bool Accept(int listener);

  // Closes connections past their deadlines: handshake not finished in time, idle, or unable to
  // take their responses.
  void Sweep();

  // Closes every connection with a queued response that pins `region`: a region being removed
  // must not wait for a slow client. The client sees the connection drop and retries elsewhere.
  void Revoke(RegionId region);

  // Whether no connection is open (the server then sleeps without a timeout).
  bool empty() const { return conns_.empty(); }
  // Reads, parses and answers what `fd`'s connection has, as epoll reported (`events`).
  void Handle(int fd, std::uint32_t events);
  // Closes every connection (the server stops).
  void CloseAll();

 private:
  // One queued response: a header (and error text) followed by bytes from registered memory.
  struct Response {
    std::uint64_t serial = 0;  // per connection, to tell responses apart in the staging buffer
    std::vector<std::uint8_t> head;
    std::vector<iovec> body;
    // Per body entry, the device it is on (null: host memory, sent in place); empty when all host.
    std::vector<device::Device*> body_dev;
    std::vector<RegionPin> pins;  // keep the regions registered while their bytes are sent
    std::size_t head_sent = 0;
    std::size_t body_index = 0;
    std::size_t body_offset = 0;
  };

  enum class Phase { kAwaitAuth, kServing, kClosing };

  struct Connection {
    Fd fd;
    std::string source;  // the client's address, for the per-source cap
    Clock::time_point accepted;
    Clock::time_point last_progress;  // last byte read or written
    Phase phase = Phase::kAwaitAuth;
    Nonce server_nonce{};
    std::vector<std::uint8_t> in;
    std::deque<Response> out;
    bool want_write = false;
    bool reading = true;
    std::uint64_t next_serial = 1;
    // Device memory goes out through two pinned buffers (docs/device.md, "tcp"). Last: its
    // destructor waits for copies still reading the pinned regions of `out`.
    SendStage stage;
  };

  bool ReadSome(Connection& c);
  bool Parse(Connection& c);
  bool Authenticate(Connection& c, std::span<const std::uint8_t, kAuthBytes> in);
  bool Serve(Connection& c, const RequestHeader& h, std::span<const std::uint8_t> ops);
  bool Flush(Connection& c);
  void UpdateInterest(Connection& c);
  void Close(int fd);
  void RefuseConnection(const std::string& why);
  void Refuse(const Status& s);

  RegionRegistry* registry_;
  const std::string& secret_;
  const std::uint64_t instance_;
  ServerCounters* counters_;
  const ServerLimits limits_;
  int epoll_;
  Fd reserve_;  // a spare descriptor, given up to shed a connection when none are left
  std::map<int, std::unique_ptr<Connection>> conns_;
  std::map<std::string, std::size_t> per_source_;  // open connections by client address
};

}  // namespace kvferry::tcp
