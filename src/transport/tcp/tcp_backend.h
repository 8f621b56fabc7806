// The decode side of the tcp backend: several authenticated connections per peer, requests
// striped across them, responses received straight into the destination blocks.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "transport/backend.h"

namespace kvferry::tcp {

struct ClientOptions {
  std::string secret;
  int connections_per_peer = 4;
  std::uint64_t max_request_bytes = 8u << 20;
  std::chrono::milliseconds user_timeout{5000};
};

class TcpBackend final : public Backend {
 public:
  explicit TcpBackend(ClientOptions options) : options_(std::move(options)) {}
  const char* name() const override { return "tcp"; }
  Result<std::unique_ptr<BackendPeer>> Connect(const PeerDescriptor& peer,
                                               Deadline deadline) override;

 private:
  ClientOptions options_;
};

}  // namespace kvferry::tcp
