// FinishedNotifier against real listeners in this process: batching per peer, linger, batch
// size, failures reported through the callback, deadlines, and that a dead peer does not delay
// notices to the others.
#include "sidechannel/notifier.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <set>

#include "common/clock.h"
#include "common/ports.h"
#include "sidechannel/listener.h"

namespace kvferry::sidechannel {
namespace {

using std::chrono::milliseconds;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAreArray;

// A listener that records the finished notices it handles. While `hold` is set its handler waits
// (with a deadline) until it is cleared, like a peer that stopped answering.
class Peer {
 public:
  explicit Peer(std::function<wire::Message(const wire::FinishedNotice&)> reply = nullptr)
      : reply_(std::move(reply)) {
    ListenerOptions o;
    o.base_port = FreeLoopbackPorts(1);
    Result<std::unique_ptr<Listener>> l =
        Listener::Start(o, [this](const wire::Message& m) { return Handle(m); });
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    listener_ = std::move(l).value();
  }
  ~Peer() {
    Release();
    listener_.reset();
  }

  const std::string& endpoint() const { return listener_->endpoint(); }
  std::vector<wire::FinishedNotice> notices() {
    std::lock_guard<std::mutex> lock(mu_);
    return notices_;
  }
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = true;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      hold_ = false;
    }
    cv_.notify_all();
  }
  // Waits until a request is being held.
  bool WaitHeld(Deadline deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock, deadline, [&] { return holding_ > 0; });
  }

 private:
  wire::Message Handle(const wire::Message& m) {
    const auto* notice = std::get_if<wire::FinishedNotice>(&m);
    if (notice == nullptr) return wire::ErrorReply{StatusCode::kInvalidArgument, "unexpected"};
    std::unique_lock<std::mutex> lock(mu_);
    ++holding_;
    cv_.notify_all();
    cv_.wait_until(lock, DeadlineAfter(milliseconds(20000)), [&] { return !hold_; });
    --holding_;
    notices_.push_back(*notice);
    lock.unlock();
    if (reply_) return reply_(*notice);
    return wire::Ack{static_cast<std::uint32_t>(notice->request_ids.size())};
  }

  std::function<wire::Message(const wire::FinishedNotice&)> reply_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false;
  int holding_ = 0;
  std::vector<wire::FinishedNotice> notices_;
  std::unique_ptr<Listener> listener_;
};

// What the notifier's callback reported.
class Reports {
 public:
  FinishedNotifier::Callback Callback() {
    return
        [this](const std::string& endpoint, const std::vector<std::string>& ids, const Status& s) {
          {
            std::lock_guard<std::mutex> lock(mu_);
            batches_.push_back({endpoint, ids, s});
          }
          cv_.notify_all();
        };
  }
  struct Batch {
    std::string endpoint;
    std::vector<std::string> ids;
    Status status;
  };
  // Waits until `n` batches were reported; returns them.
  std::vector<Batch> WaitFor(std::size_t n, Deadline deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return batches_.size() >= n; });
    return batches_;
  }
  std::vector<Batch> Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return batches_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Batch> batches_;
};

std::unique_ptr<Client> MakeClient(milliseconds attempt_timeout = milliseconds(2000)) {
  ClientOptions o;
  o.attempt_timeout = attempt_timeout;
  o.max_attempts = 2;
  o.backoff = milliseconds(10);
  return std::make_unique<Client>(o);
}

const wire::PeerRef kSelf{"decode-0", 1, 3};

std::vector<std::string> Ids(const std::string& prefix, int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(prefix + std::to_string(i));
  return out;
}

TEST(NotifierTest, NoticesToEachPeerGoInOneMessagePerPeer) {
  Peer a;
  Peer b;
  auto client = MakeClient();
  Reports reports;
  {
    FinishedNotifier n(client.get(), kSelf, 4, {milliseconds(60000), 4096, 2}, reports.Callback());
    for (const std::string& id : Ids("a", 50)) {
      n.Finished(a.endpoint(), id, DeadlineAfter(milliseconds(5000)));
    }
    for (const std::string& id : Ids("b", 30)) {
      n.Finished(b.endpoint(), id, DeadlineAfter(milliseconds(5000)));
    }
    n.Flush();  // sends now, despite the long linger
    EXPECT_EQ(n.batches_sent(), 2u);
  }
  ASSERT_EQ(a.notices().size(), 1u);
  ASSERT_EQ(b.notices().size(), 1u);
  EXPECT_EQ(a.notices()[0].request_ids, Ids("a", 50));
  EXPECT_EQ(b.notices()[0].request_ids, Ids("b", 30));
  // Every notice names this worker as the reader, with its TP size.
  EXPECT_EQ(a.notices()[0].from, kSelf);
  EXPECT_EQ(a.notices()[0].tp_size, 4u);
  const std::vector<Reports::Batch> got = reports.Get();
  ASSERT_EQ(got.size(), 2u);
  std::map<std::string, std::vector<std::string>> by_peer;
  for (const auto& r : got) {
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    by_peer[r.endpoint] = r.ids;
  }
  EXPECT_EQ(by_peer[a.endpoint()], Ids("a", 50));
  EXPECT_EQ(by_peer[b.endpoint()], Ids("b", 30));
}

TEST(NotifierTest, WithoutFlushANoticeIsSentAfterItsLinger) {
  Peer a;
  auto client = MakeClient();
  Reports reports;
  FinishedNotifier n(client.get(), kSelf, 4, {milliseconds(50), 4096, 1}, reports.Callback());
  const auto start = Clock::now();
  n.Finished(a.endpoint(), "r1", DeadlineAfter(milliseconds(5000)));
  n.Finished(a.endpoint(), "r2", DeadlineAfter(milliseconds(5000)));
  const std::vector<Reports::Batch> got = reports.WaitFor(1, DeadlineAfter(milliseconds(5000)));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_GE(Clock::now() - start, milliseconds(50));  // it waited for others to join
  EXPECT_THAT(got[0].ids, ElementsAre("r1", "r2"));
  EXPECT_TRUE(got[0].status.ok());
}

TEST(NotifierTest, AFullBatchIsSentAtOnceAndLargerOnesAreSplit) {
  Peer a;
  auto client = MakeClient();
  Reports reports;
  FinishedNotifier n(client.get(), kSelf, 4, {milliseconds(60000), 3, 1}, reports.Callback());
  for (const std::string& id : Ids("r", 3)) {
    n.Finished(a.endpoint(), id, DeadlineAfter(milliseconds(5000)));
  }
  // max_batch reached: sent without waiting out the minute of linger and without Flush.
  std::vector<Reports::Batch> got = reports.WaitFor(1, DeadlineAfter(milliseconds(5000)));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].ids, Ids("r", 3));
  for (const std::string& id : Ids("s", 7)) {
    n.Finished(a.endpoint(), id, DeadlineAfter(milliseconds(5000)));
  }
  n.Flush();
  got = reports.Get();
  std::vector<std::size_t> sizes;
  std::vector<std::string> all;
  for (const auto& r : got) {
    sizes.push_back(r.ids.size());
    all.insert(all.end(), r.ids.begin(), r.ids.end());
  }
  // No message carries more than max_batch ids, and every id is sent once.
  for (std::size_t s : sizes) EXPECT_LE(s, 3u);
  std::vector<std::string> want = Ids("r", 3);
  for (const std::string& id : Ids("s", 7)) want.push_back(id);
  EXPECT_THAT(all, UnorderedElementsAreArray(want));
  EXPECT_EQ(n.batches_sent(), got.size());
  EXPECT_EQ(a.notices().size(), got.size());
}

// Nothing listens at the endpoint: the callback reports the failure with the ids it carried, by
// the notice's deadline, and Flush returns.
TEST(NotifierTest, AnUnreachablePeerIsReportedAsAFailureByTheDeadline) {
  const std::string nobody = "tcp://127.0.0.1:" + std::to_string(FreeLoopbackPorts(1));
  auto client = MakeClient(milliseconds(200));
  Reports reports;
  FinishedNotifier n(client.get(), kSelf, 4, {milliseconds(1), 4096, 1}, reports.Callback());
  const auto start = Clock::now();
  n.Finished(nobody, "lost-1", DeadlineAfter(milliseconds(500)));
  n.Finished(nobody, "lost-2", DeadlineAfter(milliseconds(500)));
  n.Flush();
  EXPECT_LT(Clock::now() - start, milliseconds(3000));
  const std::vector<Reports::Batch> got = reports.Get();
  ASSERT_FALSE(got.empty());
  std::vector<std::string> ids;
  for (const auto& r : got) {
    EXPECT_FALSE(r.status.ok());
    EXPECT_THAT(r.status.code(), AnyOf(StatusCode::kTimeout, StatusCode::kUnavailable));
    EXPECT_EQ(r.endpoint, nobody);
    ids.insert(ids.end(), r.ids.begin(), r.ids.end());
  }
  EXPECT_THAT(ids, UnorderedElementsAreArray(std::vector<std::string>{"lost-1", "lost-2"}));
}

// The earliest deadline of the notices in a batch bounds its send, even when one attempt may
// take longer: a peer that holds the request fails the batch with Timeout at that deadline.
TEST(NotifierTest, TheEarliestDeadlineInABatchBoundsItsSend) {
  Peer slow;
  slow.Hold();
  auto client = MakeClient(milliseconds(10000));
  Reports reports;
  FinishedNotifier n(client.get(), kSelf, 4, {milliseconds(20), 4096, 1}, reports.Callback());
  const auto start = Clock::now();
  n.Finished(slow.endpoint(), "late", DeadlineAfter(milliseconds(60000)));
  n.Finished(slow.endpoint(), "urgent", DeadlineAfter(milliseconds(300)));
  const std::vector<Reports::Batch> got = reports.WaitFor(1, DeadlineAfter(milliseconds(5000)));
  const auto took = Clock::now() - start;
  slow.Release();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status.code(), StatusCode::kTimeout) << got[0].status.ToString();
  EXPECT_LT(took, milliseconds(3000));
}

TEST(NotifierTest, AnErrorReplyIsTheBatchsStatus) {
  Peer refusing([](const wire::FinishedNotice&) -> wire::Message {
    return wire::ErrorReply{StatusCode::kResourceExhausted, "too many early notices"};
  });
  Peer odd([](const wire::FinishedNotice&) -> wire::Message {
    return wire::FinishedNotice{};  // not an answer to a notice
  });
  auto client = MakeClient();
  Reports reports;
  {
    FinishedNotifier n(client.get(), kSelf, 4, {milliseconds(1), 4096, 2}, reports.Callback());
    n.Finished(refusing.endpoint(), "r", DeadlineAfter(milliseconds(5000)));
    n.Finished(odd.endpoint(), "o", DeadlineAfter(milliseconds(5000)));
    n.Flush();
  }
  std::map<std::string, Status> by_peer;
  for (const auto& r : reports.Get()) by_peer[r.endpoint] = r.status;
  ASSERT_EQ(by_peer.size(), 2u);
  EXPECT_EQ(by_peer[refusing.endpoint()].code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(by_peer[refusing.endpoint()].message(), HasSubstr("too many early notices"));
  EXPECT_EQ(by_peer[odd.endpoint()].code(), StatusCode::kInternal);
  EXPECT_THAT(by_peer[odd.endpoint()].message(), HasSubstr("answered a finished notice"));
}

// Peers are notified in parallel: while one peer holds its request, another's notice is sent and
// answered.
TEST(NotifierTest, AStuckPeerDoesNotDelayNoticesToOthers) {
  Peer stuck;
  Peer healthy;
  stuck.Hold();
  auto client = MakeClient(milliseconds(10000));
  Reports reports;
  FinishedNotifier n(client.get(), kSelf, 4, {milliseconds(1), 4096, 2}, reports.Callback());
  n.Finished(stuck.endpoint(), "s", DeadlineAfter(milliseconds(20000)));
  ASSERT_TRUE(stuck.WaitHeld(DeadlineAfter(milliseconds(5000))));
  n.Finished(healthy.endpoint(), "h", DeadlineAfter(milliseconds(5000)));
  const std::vector<Reports::Batch> got = reports.WaitFor(1, DeadlineAfter(milliseconds(5000)));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].endpoint, healthy.endpoint());
  EXPECT_TRUE(got[0].status.ok());
  stuck.Release();
  n.Flush();
  EXPECT_EQ(reports.Get().size(), 2u);
}

TEST(NotifierTest, TheDestructorSendsWhatIsPending) {
  Peer a;
  auto client = MakeClient();
  Reports reports;
  {
    FinishedNotifier n(client.get(), kSelf, 4, {milliseconds(60000), 4096, 1}, reports.Callback());
    n.Finished(a.endpoint(), "pending", DeadlineAfter(milliseconds(5000)));
  }
  ASSERT_EQ(a.notices().size(), 1u);
  EXPECT_THAT(a.notices()[0].request_ids, ElementsAre("pending"));
  ASSERT_EQ(reports.Get().size(), 1u);
  EXPECT_TRUE(reports.Get()[0].status.ok());
}

}  // namespace
}  // namespace kvferry::sidechannel
