// Workers that the in-process integration tests start (groups_test, layerwise_scale_test): one
// role of one engine on a base port, over a named data plane, at a TP rank.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "kvferry/connector.h"

namespace kvferry::testing {

inline std::unique_ptr<Worker> MakeTestWorker(Role role, const std::string& engine, int base_port,
                                              const std::string& backend,
                                              std::chrono::milliseconds transfer_timeout,
                                              int tp_size = 1, int tp_rank = 0) {
  WorkerConfig c;
  c.role = role;
  c.engine_id = engine;
  c.base_port = base_port;
  c.tp_size = tp_size;
  c.tp_rank = tp_rank;
  c.transport.backend = backend;
  c.transfer_timeout = transfer_timeout;
  Result<std::unique_ptr<Worker>> w = Worker::Create(c);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  return std::move(w).value();
}

}  // namespace kvferry::testing
