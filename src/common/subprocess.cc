#include "common/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <thread>

#include "common/errno_text.h"

extern char** environ;

namespace kvferry {

Result<Subprocess> Subprocess::Spawn(const std::vector<std::string>& argv,
                                     const std::vector<std::string>& env) {
  int in[2];
  int out[2];
  if (pipe2(in, O_CLOEXEC) != 0)
    return Status::Unavailable("pipe: " + std::string(ErrnoText(errno)));
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return Status::Unavailable("pipe: " + std::string(ErrnoText(errno)));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_strings;
  // Entries of `env` replace this process's variables of the same name (getenv takes the first).
  auto overridden = [&env](std::string_view entry) {
    const std::string_view name = entry.substr(0, entry.find('=') + 1);
    for (const std::string& e : env) {
      if (std::string_view(e).substr(0, e.find('=') + 1) == name) return true;
    }
    return false;
  };
  for (char** e = environ; *e != nullptr; ++e) {
    if (!overridden(*e)) env_strings.emplace_back(*e);
  }
  env_strings.insert(env_strings.end(), env.begin(), env.end());
  std::vector<char*> envp;
  envp.reserve(env_strings.size() + 1);
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(in[0]);
  close(out[1]);
  if (rc != 0) {
    close(in[1]);
    close(out[0]);
    return Status::Unavailable("cannot start " + argv[0] + ": " + ErrnoText(rc));
  }
  return Subprocess(pid, in[1], out[0]);
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(other.pid_),
      stdin_(other.stdin_),
      stdout_(other.stdout_),
      reaped_(other.reaped_),
      buffer_(std::move(other.buffer_)) {
  other.pid_ = -1;
  other.stdin_ = -1;
  other.stdout_ = -1;
}

Subprocess& Subprocess::operator=(Subprocess&& other) noexcept {
  if (this != &other) {
    Reset();
    pid_ = other.pid_;
    stdin_ = other.stdin_;
    stdout_ = other.stdout_;
    reaped_ = other.reaped_;
    buffer_ = std::move(other.buffer_);
    other.pid_ = -1;
    other.stdin_ = -1;
    other.stdout_ = -1;
  }
  return *this;
}

Subprocess::~Subprocess() { Reset(); }

void Subprocess::Reset() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGCONT);  // a stopped child cannot exit
    if (!CloseAndWait(std::chrono::milliseconds(2000)).ok()) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  if (stdin_ >= 0) close(stdin_);
  if (stdout_ >= 0) close(stdout_);
  pid_ = -1;
  stdin_ = -1;
  stdout_ = -1;
}

Result<std::string> Subprocess::ReadLine(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const std::size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return Status::Timeout("child " + std::to_string(pid_) + " wrote no line in time");
    }
    pollfd p{stdout_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(stdout_, buf, sizeof(buf));
    if (n <= 0) {
      return Status::Unavailable("child " + std::to_string(pid_) +
                                 " closed its output before writing a line");
    }
    buffer_.append(buf, static_cast<std::size_t>(n));
  }
}

Status Subprocess::WriteLine(const std::string& line) {
  const std::string data = line + "\n";
  std::size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = write(stdin_, data.data() + off, data.size() - off);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return Status::Unavailable("cannot write to child " + std::to_string(pid_) + ": " +
                                 ErrnoText(errno));
    }
    off += static_cast<std::size_t>(n);
  }
  return Status::Ok();
}

void Subprocess::Signal(int sig) const {
  if (pid_ > 0 && !reaped_) kill(pid_, sig);
}

Result<int> Subprocess::CloseAndWait(std::chrono::milliseconds timeout) {
  if (stdin_ >= 0) {
    close(stdin_);
    stdin_ = -1;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (r < 0) {
      reaped_ = true;
      return Status::Internal("waitpid failed: " + std::string(ErrnoText(errno)));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::Timeout("child " + std::to_string(pid_) + " did not exit in time");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace kvferry
