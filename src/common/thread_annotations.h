// Clang thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html), as
// leveldb's port/thread_annotations.h and abseil's base/thread_annotations.h define them. Under
// clang with -Wthread-safety (make tsa) they let the compiler check that every member marked
// GUARDED_BY(mu_) is touched only with mu_ held; under other compilers they expand to nothing.
//
// Use them with kvferry::Mutex (common/mutex.h): std::mutex in libstdc++ carries no annotations,
// so locking one is invisible to the analysis.
//
//   Mutex mu_;
//   int count_ GUARDED_BY(mu_);
//   void AddLocked(int n) REQUIRES(mu_);  // the caller holds mu_
//   void Add(int n) EXCLUDES(mu_);        // takes mu_ itself; the caller must not hold it
#pragma once

#if defined(__clang__)
#define KVFERRY_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define KVFERRY_THREAD_ANNOTATION(x)
#endif

/// On a class: its objects are capabilities (mutexes); `x` names the kind in warnings.
#define CAPABILITY(x) KVFERRY_THREAD_ANNOTATION(capability(x))

/// On a class: an RAII object that acquires capabilities in its constructor and releases them in
/// its destructor.
#define SCOPED_CAPABILITY KVFERRY_THREAD_ANNOTATION(scoped_lockable)

/// On a member: read or written only with capability `x` held.
#define GUARDED_BY(x) KVFERRY_THREAD_ANNOTATION(guarded_by(x))

/// On a pointer member: the pointed-to data is read or written only with `x` held.
#define PT_GUARDED_BY(x) KVFERRY_THREAD_ANNOTATION(pt_guarded_by(x))

/// On a mutex member: the order in which it is taken relative to the listed mutexes.
#define ACQUIRED_BEFORE(...) KVFERRY_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) KVFERRY_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))

/// On a function: the caller holds the capabilities (exclusively, or at least shared).
#define REQUIRES(...) KVFERRY_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) KVFERRY_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))

/// On a function: it acquires the capabilities and returns holding them (no argument on a member
/// of a capability class: the object itself).
#define ACQUIRE(...) KVFERRY_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) KVFERRY_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))

/// On a function: it releases the capabilities, which the caller held.
#define RELEASE(...) KVFERRY_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) KVFERRY_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))

/// On a function: it tries to acquire the capabilities; the first argument is the return value
/// that means it succeeded.
#define TRY_ACQUIRE(...) KVFERRY_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define TRY_ACQUIRE_SHARED(...) \
  KVFERRY_THREAD_ANNOTATION(try_acquire_shared_capability(__VA_ARGS__))

/// On a function: the caller must not hold the capabilities (the function takes them, or waits
/// for something that needs them).
#define EXCLUDES(...) KVFERRY_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))

/// On a function: calling it states that the capability is held at that point, and the analysis
/// assumes so from there on.
#define ASSERT_CAPABILITY(x) KVFERRY_THREAD_ANNOTATION(assert_capability(x))
#define ASSERT_SHARED_CAPABILITY(x) KVFERRY_THREAD_ANNOTATION(assert_shared_capability(x))

/// On a function: it returns a reference or pointer to capability `x`.
#define RETURN_CAPABILITY(x) KVFERRY_THREAD_ANNOTATION(lock_returned(x))

/// On a function: the analysis skips its body. Each use says why in a comment.
#define NO_THREAD_SAFETY_ANALYSIS KVFERRY_THREAD_ANNOTATION(no_thread_safety_analysis)
