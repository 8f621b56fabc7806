#include "common/work_queue.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvferry {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr auto kEventDeadline = 10s;  // generous: only a broken queue gets near it

TEST(WorkQueueTest, OneThreadRunsTasksInOrder) {
  std::mutex mu;
  std::vector<int> order;
  std::promise<void> done;
  {
    WorkQueue queue(1, "wq-order");
    for (int i = 0; i < 100; ++i) {
      ASSERT_TRUE(queue
                      .TryPost([&, i] {
                        std::lock_guard<std::mutex> lock(mu);
                        order.push_back(i);
                      })
                      .ok());
    }
    ASSERT_TRUE(queue.TryPost([&] { done.set_value(); }).ok());
    ASSERT_EQ(done.get_future().wait_for(kEventDeadline), std::future_status::ready);
  }
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[static_cast<std::size_t>(i)], i);
}

// A task that blocks its thread until released, so that later tasks stay queued.
struct Blocker {
  std::promise<void> started;
  std::promise<void> release;
  std::function<void()> Task() {
    return [this] {
      started.set_value();
      release_future.wait_for(kEventDeadline);
    };
  }
  std::shared_future<void> release_future = release.get_future().share();
};

TEST(WorkQueueTest, TryPostPastCapacityIsRefusedAndTheTaskNeverRuns) {
  Blocker blocker;
  std::atomic<int> ran{0};
  std::atomic<bool> refused_ran{false};
  std::promise<void> second_done;
  {
    WorkQueue queue(1, "wq-cap", /*capacity=*/2);
    ASSERT_TRUE(queue.TryPost(blocker.Task()).ok());
    ASSERT_EQ(blocker.started.get_future().wait_for(kEventDeadline), std::future_status::ready);
    EXPECT_EQ(queue.queued(), 0u);  // the running task is not queued
    ASSERT_TRUE(queue.TryPost([&] { ++ran; }).ok());
    EXPECT_EQ(queue.queued(), 1u);
    ASSERT_TRUE(queue
                    .TryPost([&] {
                      ++ran;
                      second_done.set_value();
                    })
                    .ok());
    EXPECT_EQ(queue.queued(), 2u);
    Status full = queue.TryPost([&] { refused_ran = true; });
    EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
    EXPECT_THAT(full.message(), HasSubstr("2 tasks are queued"));
    EXPECT_EQ(queue.queued(), 2u);
    blocker.release.set_value();
    ASSERT_EQ(second_done.get_future().wait_for(kEventDeadline), std::future_status::ready);
    EXPECT_EQ(queue.queued(), 0u);
    // Room again.
    EXPECT_TRUE(queue.TryPost([&] { ++ran; }).ok());
  }  // the destructor (kRun) runs what is still queued
  EXPECT_EQ(ran.load(), 3);
  EXPECT_FALSE(refused_ran.load());
}

// The first task runs while the queue is destroyed: it waits until the destructor has begun
// (TryPost answers Cancelled), posting what it can meanwhile, and then finishes. It counts the
// tasks it queued and those of the queued tasks that ran.
struct ShutdownProbe {
  std::promise<void> started;  // the running task left the queue
  std::promise<void> posted;   // the test queued its tasks
  std::atomic<int> queued_by_running{0};
  std::atomic<bool> saw_cancelled{false};
  std::atomic<bool> running_finished{false};
  std::atomic<int> queued_ran{0};
  Status cancelled;

  std::function<void()> RunningTask(WorkQueue** queue) {
    std::shared_future<void> go = posted.get_future().share();
    return [this, queue, go] {
      started.set_value();
      if (go.wait_for(kEventDeadline) != std::future_status::ready) return;
      const auto deadline = std::chrono::steady_clock::now() + kEventDeadline;
      while (std::chrono::steady_clock::now() < deadline) {
        Status s = (*queue)->TryPost([this] { ++queued_ran; });
        if (s.code() == StatusCode::kCancelled) {
          saw_cancelled = true;
          cancelled = s;
          break;
        }
        if (s.ok()) ++queued_by_running;
        std::this_thread::yield();
      }
      running_finished = true;
    };
  }
};

TEST(WorkQueueTest, DestructorWithRunRunsEveryQueuedTask) {
  ShutdownProbe probe;
  auto queue = std::make_unique<WorkQueue>(1, "wq-run", 8, WorkQueue::OnStop::kRun);
  WorkQueue* raw = queue.get();
  queue->Post(probe.RunningTask(&raw));
  ASSERT_EQ(probe.started.get_future().wait_for(kEventDeadline), std::future_status::ready);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(queue->TryPost([&] { ++probe.queued_ran; }).ok());
  probe.posted.set_value();
  queue.reset();
  EXPECT_TRUE(probe.saw_cancelled.load()) << "TryPost never answered Cancelled during shutdown";
  EXPECT_THAT(probe.cancelled.message(), HasSubstr("shutting down"));
  EXPECT_TRUE(probe.running_finished.load());
  EXPECT_EQ(probe.queued_ran.load(), 5 + probe.queued_by_running.load());
}

TEST(WorkQueueTest, DestructorWithDropRunsNoQueuedTaskButFinishesTheRunningOne) {
  ShutdownProbe probe;
  auto queue = std::make_unique<WorkQueue>(1, "wq-drop", 8, WorkQueue::OnStop::kDrop);
  WorkQueue* raw = queue.get();
  queue->Post(probe.RunningTask(&raw));
  ASSERT_EQ(probe.started.get_future().wait_for(kEventDeadline), std::future_status::ready);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(queue->TryPost([&] { ++probe.queued_ran; }).ok());
  probe.posted.set_value();
  queue.reset();
  EXPECT_TRUE(probe.saw_cancelled.load()) << "TryPost never answered Cancelled during shutdown";
  EXPECT_TRUE(probe.running_finished.load());
  EXPECT_EQ(probe.queued_ran.load(), 0);
}

// Dropped tasks are destroyed (their captures released) without running.
TEST(WorkQueueTest, DroppedTasksReleaseTheirCaptures) {
  ShutdownProbe probe;
  auto token = std::make_shared<int>(0);
  auto queue = std::make_unique<WorkQueue>(1, "wq-drop2", 8, WorkQueue::OnStop::kDrop);
  WorkQueue* raw = queue.get();
  queue->Post(probe.RunningTask(&raw));
  ASSERT_EQ(probe.started.get_future().wait_for(kEventDeadline), std::future_status::ready);
  ASSERT_TRUE(queue->TryPost([token] { ++*token; }).ok());
  EXPECT_EQ(token.use_count(), 2);
  probe.posted.set_value();
  queue.reset();
  EXPECT_EQ(token.use_count(), 1);
  EXPECT_EQ(*token, 0);
}

}  // namespace
}  // namespace kvferry
