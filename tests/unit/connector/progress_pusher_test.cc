// ProgressPusher (docs/layerwise.md): layer-wise progress pushed to subscribers' endpoints.

#include "connector/progress_pusher.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/ports.h"
#include "sidechannel/client.h"

namespace kvferry {
namespace {

// A decode worker with many subscriptions goes away: its pushes must not each wait the timeout
// in turn. Before, Drain sent an endpoint's whole batch one push after another, each waiting its
// timeout, so 1,024 subscribers on one endpoint held a sender (and the prefill worker's shutdown,
// which joins it) for 1,024 timeouts: LayerwiseScaleTest's teardown took 388 s under ASan. Now
// the first push that gets no answer drops the rest of that batch, counted as dropped. Counted by
// events (sent against dropped), not timed.
TEST(ProgressPusherTest, AnEndpointThatDoesNotAnswerCostsOneTimeoutPerBatchNotOnePerPush) {
  std::vector<int> taken;
  const int port = FreeLoopbackPorts(1, taken);  // nothing listens there
  sidechannel::Client client(sidechannel::ClientOptions{});
  ProgressPusherOptions options;
  options.threads = 1;
  options.timeout = std::chrono::milliseconds(100);
  constexpr int kPushes = 50;
  ProgressPusher pusher(client, options, [](const std::string&, const std::string&) {});
  std::vector<ProgressPush> pushes;
  for (int i = 0; i < kPushes; ++i) {
    ProgressPush p;
    p.endpoint = "tcp://127.0.0.1:" + std::to_string(port);
    p.subscriber = "decode/0/" + std::to_string(i);
    p.progress.transfer_id = "t" + std::to_string(i);
    p.progress.seq = 1;
    pushes.push_back(std::move(p));
  }
  pusher.Push(std::move(pushes));
  const Deadline deadline = DeadlineAfter(std::chrono::seconds(60));
  while (pusher.sent() + pusher.dropped() < std::uint64_t{kPushes} && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(pusher.sent(), 1u) << "pushes tried one after another to an endpoint that is gone";
  EXPECT_EQ(pusher.dropped(), std::uint64_t{kPushes - 1});
}

}  // namespace
}  // namespace kvferry
