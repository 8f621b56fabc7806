// A child process with its stdin and stdout on pipes: what the demo, the benchmarks and the
// multi-process tests use to run peers.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

/// Owns the child: the destructor closes its stdin (the child's signal to exit), waits up to
/// two seconds, then kills it. Move-only. Not thread-safe.
class Subprocess {
 public:
  /// Starts argv[0] (a path) with `argv` and this process's environment, where `env` entries
  /// ("NAME=value") are added or replace the variable of the same name. stderr is inherited.
  static Result<Subprocess> Spawn(const std::vector<std::string>& argv,
                                  const std::vector<std::string>& env = {});
  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();

  pid_t pid() const { return pid_; }
  /// Reads one line of the child's stdout (without the newline) within `timeout`.
  Result<std::string> ReadLine(std::chrono::milliseconds timeout);
  /// Writes `line` and a newline to the child's stdin. Thread-safe with ReadLine.
  Status WriteLine(const std::string& line);
  /// Sends a signal (SIGKILL, SIGSTOP, SIGCONT, ...).
  void Signal(int sig) const;
  /// Closes the child's stdin and waits for it to exit within `timeout`; returns its exit code,
  /// or Timeout (the child is then still running).
  Result<int> CloseAndWait(std::chrono::milliseconds timeout);

 private:
  Subprocess(pid_t pid, int in, int out) : pid_(pid), stdin_(in), stdout_(out) {}
  void Reset();

  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  bool reaped_ = false;
  std::string buffer_;
};

}  // namespace kvferry
