// The tcp backend's reading side: one connection to a peer's read server and the thread that
// drives it. The client half of the handshake, pipelined read requests, and responses received
// straight into their destination memory (device memory through pinned staging). TcpPeer
// (tcp_backend.cc) stripes a batch's requests over several of these.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "device/device.h"
#include "kvferry/transport.h"
#include "transport/batch.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_options.h"
#include "transport/tcp/tcp_section.h"

namespace kvferry::tcp {

// One request of a batch to a peer's read server: at most kMaxRequestBytes and
// kMaxOpsPerRequest (frames.h).
struct Request {
  std::shared_ptr<Batch> batch;
  std::vector<ReadOp> ops;
  std::uint64_t bytes = 0;
  int attempts = 0;
  // Per op, the device its local memory is on (null: host); empty when every op lands in host
  // memory. Device ops are received through pinned staging (docs/device.md, "tcp").
  std::vector<device::Device*> devices;
};

// Runs the client half of the handshake on a fresh socket to `peer`, which must prove it is the
// server instance the peer's descriptor named. Only a refused proof is Unauthenticated: a
// handshake that times out or whose connection breaks keeps that status, so the caller may retry.
Status Handshake(int fd, const TcpEndpoint& peer, const std::string& secret, Deadline deadline,
                 const StopCheck& also_stop = nullptr);

// One connection and the thread that drives it. Requests queue here; the thread sends up to
// kPipelineDepth of them, then receives the oldest response into its destination memory.
class ClientConnection {
 public:
  // `staging_gauge` counts the pinned bytes this connection holds (TransportStats::staging_bytes).
  ClientConnection(TcpEndpoint endpoint, const ClientOptions& options, Fd fd,
                   std::atomic<std::uint64_t>* staging_gauge);
  ~ClientConnection();
  ClientConnection(const ClientConnection&) = delete;
  ClientConnection& operator=(const ClientConnection&) = delete;

  // Any thread. Queues `r`; ends it PeerDisconnected when the connection is shutting down.
  void Enqueue(Request r) EXCLUDES(mu_);
  // Any thread. Requests queued or in flight, for picking the least-loaded connection.
  std::size_t Load() EXCLUDES(mu_);

 private:
  // Pinned staging per device: two buffers, so the wire fills one while the device copies the
  // other; a buffer is reused only after its copy's event completed.
  struct StageSlot {
    std::unique_ptr<device::PinnedBuffer> buffer;
    std::unique_ptr<device::Event> event;  // the copy out of `buffer`, until waited for
  };
  struct Staging {
    std::unique_ptr<device::Stream> stream;
    StageSlot slots[2];
    int next = 0;
  };

  void Run() EXCLUDES(mu_);

  // Sends what the pipeline allows, then receives one response.
  void Step() EXCLUDES(mu_);
  Status Send(Request& r) EXCLUDES(mu_);
  Status Receive(Request& r, std::uint64_t* received) EXCLUDES(mu_);

  // The payload of a request with ops landing in device memory: host ops straight into their
  // memory, device ops through this connection's staging buffers and a host-to-device copy.
  // Every copy issued has ended when this returns, so nothing writes after the unit ends.
  // Staging that cannot be set up or a copy that fails is Internal: the rest of the payload is
  // unread, so the connection is dropped.
  Status ReceiveStaged(Request& r, const StopCheck& stop, std::uint64_t* received) EXCLUDES(mu_);
  Result<Staging*> StagingFor(device::Device& dev);

  // Waits for the copy out of `slot`'s buffer, if one was issued.
  static Status WaitSlot(StageSlot& slot);

  // Ends queued requests of stopped batches. Returns true if a pipelined (sent, not yet
  // received) request belongs to a stopped batch, which only dropping the connection can end.
  bool SweepStopped() EXCLUDES(mu_);

  // The connection is unusable: close it, retry in-flight requests once on a new one. Requests
  // dropped only to abandon another batch are retried without counting an attempt.
  void Broken(const Status& why) EXCLUDES(mu_);

  // Connects again while requests wait. Stops as soon as none is left to carry: queued requests
  // of stopped batches end meanwhile, so a Cancel never waits for a reconnect.
  Status Reconnect() EXCLUDES(mu_);
  void FailAll(const Status& s) EXCLUDES(mu_);
  static Status Disconnected();
  bool ShuttingDown() EXCLUDES(mu_);
  const TcpEndpoint endpoint_;
  const ClientOptions& options_;
  Fd fd_;  // used by the thread only
  std::atomic<std::uint64_t>* const staging_gauge_;
  std::deque<std::uint64_t> sent_ids_;          // thread only
  std::map<device::Device*, Staging> staging_;  // thread only
  std::uint64_t next_id_ = 1;                   // thread only
  Mutex mu_;
  CondVar cv_;
  std::deque<Request> queue_ GUARDED_BY(mu_);
  std::deque<Request> in_flight_ GUARDED_BY(mu_);
  bool shutting_down_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvferry::tcp
