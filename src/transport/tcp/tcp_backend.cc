#include "transport/tcp/tcp_backend.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "common/mutex.h"
#include "device/device.h"
#include "transport/tcp/frames.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_client.h"

namespace kvferry::tcp {
namespace {

class TcpPeer final : public BackendPeer {
 public:
  TcpPeer(const ClientOptions& options, std::vector<std::unique_ptr<ClientConnection>> conns)
      : options_(options), conns_(std::move(conns)) {}
  ~TcpPeer() override { Shutdown(); }

  void Start(const std::shared_ptr<Batch>& batch, std::vector<ReadOp> ops) override EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (conns_.empty()) {
      // Shut down (the peer was disconnected) after the caller took it: the batch ends now.
      batch->AddUnit();
      batch->UnitDone(Status::PeerDisconnected(
                          "the tcp peer was disconnected while this batch was being submitted"),
                      0);
      return;
    }
    Request r{batch, {}, 0, 0, {}};
    // Where each op lands, when some land in device memory (registration checked the device).
    std::vector<device::Device*> devices;
    if (!batch->local_all_host()) {
      devices.resize(ops.size());
      for (std::size_t i = 0; i < ops.size(); ++i) {
        const MemoryKind kind = batch->local_kind(i);
        if (kind.is_host()) continue;
        Result<device::Device*> dev = device::ProcessDevice(kind.ToString());
        if (!dev.ok()) {
          batch->AddUnit();
          batch->UnitDone(dev.status().WithContext("read " + std::to_string(i)), 0);
          return;
        }
        devices[i] = *dev;
      }
    }
    auto flush = [&] {
      mu_.AssertHeld();  // called only below, within this function's lock
      if (r.ops.empty()) return;
      batch->AddUnit();
      // Least-loaded connection; ties go round-robin.
      std::size_t best = next_++ % conns_.size();
      std::size_t best_load = conns_[best]->Load();
      for (std::size_t i = 0; i < conns_.size(); ++i) {
        const std::size_t load = conns_[i]->Load();
        if (load < best_load) {
          best = i;
          best_load = load;
        }
      }
      conns_[best]->Enqueue(std::move(r));
      r = Request{batch, {}, 0, 0, {}};
    };
    const std::uint64_t cap = std::min(options_.max_request_bytes, kMaxRequestBytes);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      for (std::uint64_t off = 0; off < op.length;) {
        const std::uint64_t len = std::min(op.length - off, cap - r.bytes);
        if (!devices.empty()) r.devices.push_back(devices[i]);  // in step with r.ops
        r.ops.push_back({op.local + off, op.remote_region, op.remote_offset + off, len});
        r.bytes += len;
        off += len;
        if (r.bytes >= cap || r.ops.size() >= kMaxOpsPerRequest) flush();
      }
    }
    flush();
  }

  void Shutdown() override EXCLUDES(mu_) {
    std::vector<std::unique_ptr<ClientConnection>> ending;
    {
      MutexLock lock(mu_);
      ending.swap(conns_);
    }
    ending.clear();  // each connection ends its requests and joins its thread, outside mu_
  }

 private:
  const ClientOptions& options_;
  Mutex mu_;
  std::vector<std::unique_ptr<ClientConnection>> conns_ GUARDED_BY(mu_);
  std::size_t next_ GUARDED_BY(mu_) = 0;
};

}  // namespace

Result<std::unique_ptr<TcpBackend>> TcpBackend::Create(TcpOptions options, bool serve,
                                                       RegionRegistry* regions) {
  std::unique_ptr<TcpBackend> b(new TcpBackend(std::move(options)));
  if (serve) {
    const TcpOptions& o = b->options_;
    const std::string& advertise = o.advertise_host.empty() ? o.bind_host : o.advertise_host;
    if (advertise == "0.0.0.0" || advertise == "::") {
      return Status::InvalidArgument("the tcp server binds to " + o.bind_host +
                                     "; set tcp.advertise_host to the "
                                     "address peers should connect to");
    }
    KVFERRY_ASSIGN_OR_RETURN(
        b->server_,
        TcpServer::Start(regions, o.bind_host, o.port, o.client.secret, &b->counters_, o.limits));
  }
  return b;
}

BackendFactory TcpBackend::Factory() {
  BackendFactory f;
  f.name = "tcp";
  f.check = [](const TransportOptions& options, const TransportOptionMap& own) {
    return ParseTcpOptions(options, own).status();
  };
  f.create = [](const BackendContext& ctx) -> Result<std::unique_ptr<Backend>> {
    KVFERRY_ASSIGN_OR_RETURN(TcpOptions o, ParseTcpOptions(ctx.options, ctx.own_options));
    KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<TcpBackend> b,
                             Create(std::move(o), ctx.options.serve, ctx.regions));
    return std::unique_ptr<Backend>(std::move(b));
  };
  return f;
}

TcpBackend::~TcpBackend() { server_.reset(); }

std::vector<std::uint8_t> TcpBackend::DescriptorSection() {
  if (!server_) return {};
  return EncodeTcpSection(
      TcpEndpoint{options_.advertise_host.empty() ? options_.bind_host : options_.advertise_host,
                  server_->port(), server_->instance()});
}

Status TcpBackend::CanReach(const PeerView& peer) {
  if (peer.section.empty()) {
    return Status::Unavailable("the peer runs no tcp read server; start it with serving enabled");
  }
  return DecodeTcpSection(peer.section).status();
}

void TcpBackend::RevokeRegion(RegionId region) {
  if (server_) server_->RevokeRegion(region);
}

void TcpBackend::AddStats(TransportStats* stats) const {
  stats->bytes_served += counters_.bytes_served.load();
  stats->requests_refused += counters_.refused.load();
  stats->staging_bytes += counters_.staging_bytes.load();
}

Result<std::unique_ptr<BackendPeer>> TcpBackend::Connect(const PeerView& peer, Deadline deadline) {
  KVFERRY_RETURN_IF_ERROR(CanReach(peer));
  KVFERRY_ASSIGN_OR_RETURN(const TcpEndpoint endpoint, DecodeTcpSection(peer.section));
  const ClientOptions& client = options_.client;
  std::vector<std::unique_ptr<ClientConnection>> conns;
  for (int i = 0; i < std::max(client.connections_per_peer, 1); ++i) {
    Result<Fd> fd = tcp::Connect(endpoint.host, endpoint.port, deadline, client.user_timeout);
    if (!fd.ok()) return fd.status();
    KVFERRY_RETURN_IF_ERROR(Handshake(fd->get(), endpoint, client.secret, deadline));
    conns.push_back(std::make_unique<ClientConnection>(endpoint, client, std::move(fd).value(),
                                                       &counters_.staging_bytes));
  }
  return std::unique_ptr<BackendPeer>(std::make_unique<TcpPeer>(client, std::move(conns)));
}

}  // namespace kvferry::tcp
