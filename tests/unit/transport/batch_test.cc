// Batch: units added and done, sealing, first error, cancel, fail, deadline, and that a batch
// ends exactly once with its end callback run once, before waiters see the outcome.
#include "transport/batch.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "common/clock.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

// Records every call of the end callback.
struct Ends {
  std::atomic<int> calls{0};
  std::atomic<std::uint64_t> bytes{0};
  std::atomic<int> state{-1};

  std::function<void(const BatchResult&, std::uint64_t)> Callback() {
    return [this](const BatchResult& r, std::uint64_t b) {
      state.store(static_cast<int>(r.state));
      bytes.store(b);
      calls.fetch_add(1);
    };
  }
};

std::shared_ptr<Batch> MakeBatch(Ends& ends,
                                 Deadline deadline = DeadlineAfter(milliseconds(60000))) {
  return std::make_shared<Batch>(1, deadline, std::vector<RegionPin>{}, ends.Callback());
}

TEST(BatchTest, EndsDoneWhenSealedAndEveryUnitIsDone) {
  Ends ends;
  auto b = MakeBatch(ends);
  b->AddUnit();
  b->AddUnit();
  b->Seal();
  EXPECT_EQ(b->Current().state, BatchState::kInProgress);
  b->UnitDone(Status::Ok(), 100);
  EXPECT_EQ(b->Current().state, BatchState::kInProgress);
  EXPECT_EQ(ends.calls.load(), 0);
  b->UnitDone(Status::Ok(), 28);
  const BatchResult r = b->Current();
  EXPECT_EQ(r.state, BatchState::kDone);
  EXPECT_TRUE(r.status.ok());
  EXPECT_EQ(ends.calls.load(), 1);
  EXPECT_EQ(ends.bytes.load(), 128u);
  EXPECT_EQ(ends.state.load(), static_cast<int>(BatchState::kDone));
  EXPECT_FALSE(b->ShouldStop());
}

// Units may finish before the backend has added the last one: the batch must not end until Seal.
TEST(BatchTest, DoesNotEndBeforeSeal) {
  Ends ends;
  auto b = MakeBatch(ends);
  b->AddUnit();
  b->UnitDone(Status::Ok(), 10);
  EXPECT_EQ(b->Current().state, BatchState::kInProgress);
  EXPECT_EQ(ends.calls.load(), 0);
  b->AddUnit();
  b->Seal();
  EXPECT_EQ(b->Current().state, BatchState::kInProgress);
  b->UnitDone(Status::Ok(), 5);
  EXPECT_EQ(b->Current().state, BatchState::kDone);
  EXPECT_EQ(ends.bytes.load(), 15u);
}

TEST(BatchTest, ASealedBatchWithoutUnitsEndsDoneAtOnce) {
  Ends ends;
  auto b = MakeBatch(ends);
  b->Seal();
  EXPECT_EQ(b->Current().state, BatchState::kDone);
  EXPECT_EQ(ends.calls.load(), 1);
  EXPECT_EQ(ends.bytes.load(), 0u);
}

TEST(BatchTest, TheFirstErrorStopsTheOtherUnitsAndIsTheOutcome) {
  Ends ends;
  auto b = MakeBatch(ends);
  for (int i = 0; i < 3; ++i) b->AddUnit();
  b->Seal();
  b->UnitDone(Status::Ok(), 4);
  EXPECT_FALSE(b->ShouldStop());
  b->UnitDone(Status::PeerDisconnected("peer gone"), 2);
  EXPECT_TRUE(b->ShouldStop());
  EXPECT_EQ(b->StopStatus().code(), StatusCode::kPeerDisconnected);
  EXPECT_EQ(b->Current().state, BatchState::kInProgress);  // one unit still runs
  b->UnitDone(Status::Timeout("later"), 0);
  const BatchResult r = b->Current();
  EXPECT_EQ(r.state, BatchState::kFailed);
  EXPECT_EQ(r.status.code(), StatusCode::kPeerDisconnected);
  EXPECT_THAT(r.status.message(), HasSubstr("peer gone"));
  EXPECT_EQ(ends.calls.load(), 1);
  EXPECT_EQ(ends.bytes.load(), 6u);  // bytes of failed units count too: they were written
}

// Cancel returns only once no unit runs: the unit below sees the stop request while Cancel is
// still waiting, and Cancel returns after the unit reports.
TEST(BatchTest, CancelWaitsForRunningUnitsAndEndsCancelled) {
  Ends ends;
  auto b = MakeBatch(ends);
  b->AddUnit();
  b->Seal();
  std::atomic<bool> cancel_returned{false};
  std::atomic<bool> returned_before_unit_done{false};
  std::thread unit([&] {
    const Deadline limit = DeadlineAfter(milliseconds(10000));
    while (!b->ShouldStop() && !Expired(limit)) std::this_thread::yield();
    EXPECT_TRUE(b->ShouldStop());
    EXPECT_EQ(b->StopStatus().code(), StatusCode::kCancelled);
    returned_before_unit_done.store(cancel_returned.load());
    b->UnitDone(b->StopStatus(), 0);
  });
  b->Cancel();
  cancel_returned.store(true);
  unit.join();
  EXPECT_FALSE(returned_before_unit_done.load());
  const BatchResult r = b->Current();
  EXPECT_EQ(r.state, BatchState::kCancelled);
  EXPECT_EQ(r.status.code(), StatusCode::kCancelled);
  EXPECT_EQ(ends.calls.load(), 1);
}

// A unit that fails while the batch is being cancelled does not turn the outcome into a failure.
TEST(BatchTest, AnErrorAfterCancelStillEndsCancelled) {
  Ends ends;
  auto b = MakeBatch(ends);
  b->AddUnit();
  b->Seal();
  std::thread unit([&] {
    const Deadline limit = DeadlineAfter(milliseconds(10000));
    while (!b->ShouldStop() && !Expired(limit)) std::this_thread::yield();
    b->UnitDone(Status::PeerDisconnected("connection dropped by the cancel"), 0);
  });
  b->Cancel();
  unit.join();
  EXPECT_EQ(b->Current().state, BatchState::kCancelled);
}

TEST(BatchTest, CancelOrFailAfterTheEndKeepsTheOutcomeAndDoesNotEndAgain) {
  Ends ends;
  auto b = MakeBatch(ends);
  b->AddUnit();
  b->Seal();
  b->UnitDone(Status::Ok(), 1);
  b->Cancel();
  b->Fail(Status::PeerDisconnected("too late"));
  EXPECT_EQ(b->Current().state, BatchState::kDone);
  EXPECT_TRUE(b->Current().status.ok());
  EXPECT_EQ(ends.calls.load(), 1);
}

TEST(BatchTest, FailEndsWithTheGivenStatusOnceUnitsStop) {
  Ends ends;
  auto b = MakeBatch(ends);
  b->AddUnit();
  b->Seal();
  std::thread unit([&] {
    const Deadline limit = DeadlineAfter(milliseconds(10000));
    while (!b->ShouldStop() && !Expired(limit)) std::this_thread::yield();
    b->UnitDone(b->StopStatus(), 0);
  });
  b->Fail(Status::PeerDisconnected("peer process exited"));
  unit.join();
  const BatchResult r = b->Current();
  EXPECT_EQ(r.state, BatchState::kFailed);
  EXPECT_EQ(r.status.code(), StatusCode::kPeerDisconnected);
  EXPECT_THAT(r.status.message(), HasSubstr("peer process exited"));
}

TEST(BatchTest, PastItsDeadlineUnitsStopWithTimeout) {
  Ends ends;
  auto live = MakeBatch(ends, DeadlineAfter(milliseconds(60000)));
  EXPECT_FALSE(live->ShouldStop());
  Ends late_ends;
  auto late = MakeBatch(late_ends, Clock::now() - milliseconds(1));
  EXPECT_TRUE(late->ShouldStop());
  const Status stop = late->StopStatus();
  EXPECT_EQ(stop.code(), StatusCode::kTimeout);
  EXPECT_THAT(stop.message(), HasSubstr("deadline"));
  late->AddUnit();
  late->Seal();
  late->UnitDone(stop, 0);
  EXPECT_EQ(late->Current().state, BatchState::kFailed);
  EXPECT_EQ(late->Current().status.code(), StatusCode::kTimeout);
}

TEST(BatchTest, WaitEndReturnsInProgressAtItsDeadlineAndTheOutcomeOnceEnded) {
  Ends ends;
  auto b = MakeBatch(ends);
  b->AddUnit();
  b->Seal();
  const auto start = Clock::now();
  const BatchResult waiting = b->WaitEnd(start + milliseconds(30));
  EXPECT_EQ(waiting.state, BatchState::kInProgress);
  EXPECT_GE(Clock::now() - start, milliseconds(30));
  std::thread unit([&] { b->UnitDone(Status::Ok(), 9); });
  const BatchResult ended = b->WaitEnd(DeadlineAfter(milliseconds(10000)));
  unit.join();
  EXPECT_EQ(ended.state, BatchState::kDone);
  EXPECT_EQ(ends.calls.load(), 1);  // the callback has run by the time a waiter sees the end
}

// The outcome becomes visible only after the end callback ran (so stats are current when Wait
// returns): inside the callback the batch still reads as in progress.
TEST(BatchTest, TheOutcomeIsVisibleOnlyAfterTheEndCallback) {
  std::shared_ptr<Batch> b;
  BatchState seen_inside = BatchState::kDone;
  b = std::make_shared<Batch>(2, DeadlineAfter(milliseconds(60000)), std::vector<RegionPin>{},
                              [&](const BatchResult& r, std::uint64_t) {
                                EXPECT_EQ(r.state, BatchState::kDone);
                                seen_inside = b->Current().state;
                              });
  b->AddUnit();
  b->Seal();
  b->UnitDone(Status::Ok(), 1);
  EXPECT_EQ(seen_inside, BatchState::kInProgress);
  EXPECT_EQ(b->Current().state, BatchState::kDone);
}

// Many units finishing at once on many threads: exactly one end, every byte counted.
TEST(BatchTest, ConcurrentUnitsEndTheBatchExactlyOnce) {
  constexpr int kThreads = 8;
  constexpr int kUnitsPerThread = 500;
  for (int round = 0; round < 20; ++round) {
    Ends ends;
    auto b = MakeBatch(ends);
    for (int i = 0; i < kThreads * kUnitsPerThread; ++i) b->AddUnit();
    b->Seal();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kUnitsPerThread; ++i) {
          b->UnitDone(t == 3 && i == 7 ? Status::Internal("one bad unit") : Status::Ok(), 2);
        }
      });
    }
    const BatchResult r = b->WaitEnd(DeadlineAfter(milliseconds(10000)));
    for (auto& t : threads) t.join();
    EXPECT_EQ(r.state, BatchState::kFailed);
    EXPECT_EQ(ends.calls.load(), 1);
    EXPECT_EQ(ends.bytes.load(), 2u * kThreads * kUnitsPerThread);
  }
}

}  // namespace
}  // namespace kvferry
