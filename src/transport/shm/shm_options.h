// The shm backend's options: the shm.* keys of TransportOptions::backend_options, their defaults
// (the members' initialisers below) and their parser. docs/transport.md, "Options", lists them.
#pragma once

#include "kvferry/status.h"
#include "kvferry/transport.h"
#include "transport/shm/huge_pages.h"

namespace kvferry {

struct ShmOptions {
  /// shm.threads: threads that carry out shm reads (1..256).
  int threads = 2;
  /// shm.permit_any_tracer: a serving transport calls prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY),
  /// so that under Yama's kernel.yama.ptrace_scope=1 same-user processes that are not this one's
  /// ancestors (a decode instance started beside it) may read its memory over shm. It grants more
  /// than reads: every process that the kernel's other checks allow (same user, or
  /// CAP_SYS_PTRACE) may then ptrace this process (attach, write its memory, change its
  /// registers), and it is never undone for the process. Off: no prctl, and under ptrace_scope=1
  /// such readers fail shm's check at Connect and, with backend auto, read over tcp (the log says
  /// why). Without Yama, or with ptrace_scope=0, it changes nothing.
  bool permit_any_tracer = false;
  /// shm.huge_pages: off, advise or collapse (huge_pages.h): what a serving transport does to each
  /// host region it registers, so that readers' process_vm_readv pins 2 MiB pages instead of 4 KiB
  /// ones. collapse converts the region's pages at registration, which costs time (2.6 s per GiB
  /// on this development VM) and fails on pinned memory (logged, the region is still served).
  HugePages huge_pages = HugePages::kOff;
};

/// The defaults above overridden by `own` (the shm.* keys without their prefix). InvalidArgument
/// naming the key for an unknown key or a value that does not parse or is out of range.
Result<ShmOptions> ParseShmOptions(const TransportOptions& options, const TransportOptionMap& own);

/// Whether a transport created with `options` calls prctl(PR_SET_PTRACER_ANY): only when it
/// serves, has the shm backend (backend auto, shm, or a list naming shm), and
/// shm.permit_any_tracer is set (false for options that do not parse).
bool ServingPermitsAnyTracer(const TransportOptions& options);

}  // namespace kvferry
