// `kvferry bench peer` as a test's second process: memory filled with the bench pattern and
// registered with a transport, served until the test ends (its stdin closes); the descriptor
// comes from its READY line. Needs KVFERRY_CLI_PATH (every kvferry_test has it).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "common/digest.h"
#include "common/subprocess.h"

namespace kvferry::testing {

struct BenchPeer {
  std::optional<Subprocess> process;  // absent when it could not be spawned
  std::vector<std::uint8_t>
      descriptor;  // empty when the peer did not start (a failure is recorded)
};

/// Starts `kvferry bench peer ARGS...`, with KVFERRY_SECRET=`secret` when it is not empty, and
/// waits (30 s at most) for its READY line. A failure to start is recorded as a test failure and
/// leaves the descriptor empty; callers ASSERT on it where they cannot go on without the peer.
inline BenchPeer StartBenchPeer(const std::vector<std::string>& args,
                                const std::string& secret = "") {
  std::vector<std::string> argv = {KVFERRY_CLI_PATH, "bench", "peer"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::string> env;
  if (!secret.empty()) env.push_back("KVFERRY_SECRET=" + secret);
  Result<Subprocess> p = Subprocess::Spawn(argv, env);
  if (!p.ok()) {
    ADD_FAILURE() << "starting kvferry bench peer: " << p.status().ToString();
    return {};
  }
  BenchPeer peer{std::move(p).value(), {}};
  Result<std::string> line = peer.process->ReadLine(std::chrono::seconds(30));
  if (!line.ok() || line->rfind("READY ", 0) != 0) {
    ADD_FAILURE() << "kvferry bench peer did not start: "
                  << (line.ok() ? *line : line.status().ToString());
    return peer;
  }
  Result<std::vector<std::uint8_t>> descriptor = FromHex(line->substr(6));
  EXPECT_TRUE(descriptor.ok()) << descriptor.status().ToString();
  if (descriptor.ok()) peer.descriptor = std::move(descriptor).value();
  return peer;
}

}  // namespace kvferry::testing
