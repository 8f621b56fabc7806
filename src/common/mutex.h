// A mutex, its lock guards and a condition variable, annotated for clang's thread-safety
// analysis (common/thread_annotations.h, make tsa). libstdc++'s std::mutex carries no
// annotations, so code that guards members with GUARDED_BY uses these instead:
//
//   mutable Mutex mu_;
//   CondVar changed_;
//   bool done_ GUARDED_BY(mu_) = false;
//
//   void Finish() EXCLUDES(mu_) {
//     {
//       MutexLock lock(mu_);  // like std::lock_guard
//       done_ = true;
//     }
//     changed_.SignalAll();
//   }
//
//   bool WaitDone(Deadline deadline) EXCLUDES(mu_) {
//     MutexLock lock(mu_);
//     // The predicate is written as a loop, not a lambda: the analysis checks a lambda's body as
//     // a function of its own, which does not hold mu_.
//     while (!done_) {
//       if (changed_.WaitUntil(mu_, deadline)) break;  // timed out
//     }
//     return done_;
//   }
//
// UniqueLock is the guard for code that unlocks before the end of the scope (to run a callback
// or a network call without the lock) and may lock again. A function that needs the caller to
// hold a mutex says so with REQUIRES(mu_); one that takes it, or waits for something another
// thread does under it, says EXCLUDES(mu_).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "common/thread_annotations.h"

namespace kvferry {

/// A std::mutex the analysis can see. Also BasicLockable (lock, unlock), for std templates.
class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

  /// Tells the analysis that the calling thread holds this mutex, where it cannot see so itself.
  /// Not checked at run time: std::mutex does not know its owner.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

/// Holds `mu` from construction to the end of the scope, like std::lock_guard.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

/// Holds `mu` from construction; Unlock releases it before the end of the scope and Lock takes it
/// again, like std::unique_lock. The destructor unlocks only if the lock is held.
class SCOPED_CAPABILITY UniqueLock {
 public:
  explicit UniqueLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~UniqueLock() RELEASE() {
    if (locked_) mu_.unlock();
  }
  UniqueLock(const UniqueLock&) = delete;
  UniqueLock& operator=(const UniqueLock&) = delete;

  void Unlock() RELEASE() {
    mu_.unlock();
    locked_ = false;
  }
  void Lock() ACQUIRE() {
    mu_.lock();
    locked_ = true;
  }

 private:
  Mutex& mu_;
  bool locked_ = true;
};

/// A condition variable used with a Mutex the caller holds. Each wait releases `mu` while it
/// blocks and holds it again when it returns; wake-ups may be spurious, so callers wait in a
/// loop that tests their condition.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  /// Waits for a Signal or SignalAll (or a spurious wake-up).
  void Wait(Mutex& mu) REQUIRES(mu) {
    Adopted lock(mu);
    cv_.wait(lock.lock);
  }

  /// As Wait, but returns by `deadline` at the latest: true if it returned because the deadline
  /// passed, false if it was woken.
  template <class Clock, class Duration>
  bool WaitUntil(Mutex& mu, const std::chrono::time_point<Clock, Duration>& deadline) REQUIRES(mu) {
    Adopted lock(mu);
    return cv_.wait_until(lock.lock, deadline) == std::cv_status::timeout;
  }

  /// Wakes one waiter, or all. The caller may or may not hold the mutex.
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  // Lends the caller's lock on `mu` to std::condition_variable for one wait and leaves it held
  // afterwards, also if the wait throws.
  struct Adopted {
    explicit Adopted(Mutex& mu) : lock(mu.mu_, std::adopt_lock) {}
    ~Adopted() { lock.release(); }
    Adopted(const Adopted&) = delete;
    Adopted& operator=(const Adopted&) = delete;
    std::unique_lock<std::mutex> lock;
  };

  std::condition_variable cv_;
};

}  // namespace kvferry
