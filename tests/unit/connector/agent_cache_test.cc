// The decode side's agent cache alone: a fake prefill rank (a side-channel listener answering
// metadata requests, with a tcp transport's descriptor) whose engine id the test changes.
#include "connector/agent_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/ports.h"
#include "sidechannel/listener.h"
#include "tests/integration/kv_test_cache.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

// One prefill rank as the cache sees it: its engine id can change (a restart on the same port).
class FakePrefillRank {
 public:
  explicit FakePrefillRank(std::string engine)
      : engine_(std::move(engine)), spec_(*testing::TestSpec("mha", 1, 0)) {
    TransportOptions t;
    t.backend = "tcp";
    transport_ = std::move(CreateTransport(t)).value();
    sidechannel::ListenerOptions o;
    o.base_port = FreeLoopbackPorts(1);
    listener_ = std::move(sidechannel::Listener::Start(o, [this](const wire::Message&) {
                  handled_.fetch_add(1);
                  return Metadata();
                })).value();
  }
  const std::string& endpoint() const { return listener_->endpoint(); }
  void set_engine(const std::string& e) {
    std::lock_guard<std::mutex> lock(mu_);
    engine_ = e;
  }
  int handled() const { return handled_.load(); }
  const CacheSpec& spec() const { return spec_; }

 private:
  wire::Message Metadata() {
    wire::AgentIdentity agent;
    {
      std::lock_guard<std::mutex> lock(mu_);
      agent.peer.engine_id = engine_;
    }
    agent.tp_size = 1;
    return wire::AgentMetadata{
        agent, listener_->endpoint(), {{kTransportKind, *transport_->Descriptor()}},
        spec_, spec_.Hash(),          {}};
  }

  std::mutex mu_;
  std::string engine_;  // guarded by mu_
  CacheSpec spec_;
  std::atomic<int> handled_{0};
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<sidechannel::Listener> listener_;  // last: its handler uses the rest
};

class AgentCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TransportOptions t;
    t.backend = "tcp";
    t.serve = false;
    transport_ = std::move(CreateTransport(t)).value();
    client_ = std::make_unique<sidechannel::Client>(sidechannel::ClientOptions{});
  }
  std::unique_ptr<AgentCache> MakeCache(const CacheSpec& spec, int max_agents = 8) {
    auto c = std::make_unique<AgentCache>(*client_, *transport_, wire::PeerRef{"decode", 0, 0},
                                          max_agents);
    c->SetLocalCache(spec);
    return c;
  }
  static AgentKey Key(const FakePrefillRank& p, const std::string& engine) {
    return {p.endpoint(), engine, 0, 1};
  }

  std::unique_ptr<Transport> transport_;
  std::unique_ptr<sidechannel::Client> client_;
};

TEST_F(AgentCacheTest, ConcurrentLoadsShareOneHandshakeAndLaterOnesUseTheCache) {
  FakePrefillRank p("prefill-a");
  auto cache = MakeCache(p.spec());
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      if (cache->Get(Key(p, "prefill-a"), DeadlineAfter(milliseconds(10000))).ok()) ++ok;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_TRUE(cache->Get(Key(p, "prefill-a"), DeadlineAfter(milliseconds(10000))).ok());
  EXPECT_EQ(cache->Stats().handshakes, 1u);
  EXPECT_EQ(p.handled(), 1);
}

TEST_F(AgentCacheTest, AMismatchedEngineOrLayoutIsRefusedAndNotCached) {
  FakePrefillRank p("prefill-a");
  auto cache = MakeCache(p.spec());
  Result<std::shared_ptr<RemoteAgent>> wrong =
      cache->Get(Key(p, "prefill-b"), DeadlineAfter(milliseconds(10000)));
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(), HasSubstr("is engine prefill-a"));
  EXPECT_TRUE(cache->Get(Key(p, "prefill-a"), DeadlineAfter(milliseconds(10000))).ok());
  EXPECT_EQ(cache->Stats().handshakes, 2u);  // the failed one was not kept
  auto other_layout = MakeCache(*testing::TestSpec("mla", 1, 0));
  Result<std::shared_ptr<RemoteAgent>> layout =
      other_layout->Get(Key(p, "prefill-a"), DeadlineAfter(milliseconds(10000)));
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), StatusCode::kNotSupported);
  EXPECT_THAT(layout.status().message(),
              HasSubstr("differ, so no byte may move; first difference"));
}

TEST_F(AgentCacheTest, ARestartedEngineReplacesTheStaleAgentAndTheOldOneIsNotReadAsNew) {
  FakePrefillRank p("prefill-old");
  auto cache = MakeCache(p.spec());
  auto old = cache->Get(Key(p, "prefill-old"), DeadlineAfter(milliseconds(10000)));
  ASSERT_TRUE(old.ok());
  p.set_engine("prefill-new");  // restarted on the same port
  auto fresh = cache->Get(Key(p, "prefill-new"), DeadlineAfter(milliseconds(10000)));
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_NE(fresh->get(), old->get());
  EXPECT_EQ((*fresh)->metadata->agent.peer.engine_id, "prefill-new");
  // A load naming the gone engine gets the cached agent back, which names the new engine: the
  // caller refuses it; the cached agent stays.
  auto stale = cache->Get(Key(p, "prefill-old"), DeadlineAfter(milliseconds(10000)));
  ASSERT_TRUE(stale.ok());
  EXPECT_EQ(stale->get(), fresh->get());
  EXPECT_EQ(cache->Stats().handshakes, 2u);
}

TEST_F(AgentCacheTest, TheLeastRecentlyUsedIdleAgentMakesRoomAndBusyOnesAreKept) {
  FakePrefillRank a("prefill-a");
  FakePrefillRank b("prefill-b");
  FakePrefillRank c("prefill-c");
  auto cache = MakeCache(a.spec(), /*max_agents=*/2);
  auto held = cache->Get(Key(a, "prefill-a"), DeadlineAfter(milliseconds(10000)));
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(cache->Get(Key(b, "prefill-b"), DeadlineAfter(milliseconds(10000))).ok());
  // a is in use (held), so b is evicted for c.
  ASSERT_TRUE(cache->Get(Key(c, "prefill-c"), DeadlineAfter(milliseconds(10000))).ok());
  EXPECT_EQ(cache->Stats().evicted, 1u);
  EXPECT_TRUE(cache->Get(Key(a, "prefill-a"), DeadlineAfter(milliseconds(10000))).ok());
  EXPECT_EQ(a.handled(), 1) << "the agent in use was evicted";
  // Both cached agents in use: a third endpoint is refused, not waited for.
  auto held_c = cache->Get(Key(c, "prefill-c"), DeadlineAfter(milliseconds(10000)));
  ASSERT_TRUE(held_c.ok());
  Result<std::shared_ptr<RemoteAgent>> full =
      cache->Get(Key(b, "prefill-b"), DeadlineAfter(milliseconds(10000)));
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace kvferry
