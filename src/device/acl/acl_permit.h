// How an NPU IPC reader's pid reaches the exporter (docs/device.md, "The acl device", IPC).
//
// CANN admits an importer only if the exporting process put the importer's bare tgid
// (aclrtDeviceGetBareTgid: its pid as the host sees it) on the key's whitelist
// (aclrtIpcMemSetImportPid) first. The key travels from exporter to reader inside the IpcHandle
// (in kvferry: the shm section of the transport descriptor); the pid must travel back. The
// exporting device serves a Linux abstract unix socket whose name is in the handle next to the
// key; the reader connects, sends the key and its bare tgid, and imports once the exporter has
// answered. The exporter checks the connecting process with SO_PEERCRED: same user, and where the
// exporter runs in the host's pid namespace (its bare tgid is its pid), the claimed pid must be
// the peer's own. Everything stays in the device layer: no side-channel message changes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "kvferry/status.h"
#include "kvferry/transport.h"  // Deadline

namespace kvferry::device {

/// The exporter's side: one thread that answers permit requests one at a time, each within 1 s
/// (a reader that sends nothing is dropped after that).
class AclPermitServer {
 public:
  /// Decides one request that passed the credential checks: OK admits `pid` to `key`. Called on
  /// the server's thread (which must make the device current itself).
  using Permit = std::function<Status(const std::string& key, std::int32_t pid)>;

  /// Binds "kvferry-acl-permit-<pid>-<random>" and starts the thread. `host_pid_namespace`: this
  /// process's bare tgid equals its pid, so a reader's claimed pid can be checked against
  /// SO_PEERCRED. Unavailable when the socket cannot be made.
  static Result<std::unique_ptr<AclPermitServer>> Start(Permit permit, bool host_pid_namespace);
  /// Stops the thread (a request being answered finishes first) and closes the socket.
  ~AclPermitServer();
  AclPermitServer(const AclPermitServer&) = delete;
  AclPermitServer& operator=(const AclPermitServer&) = delete;

  const std::string& name() const { return name_; }

 private:
  AclPermitServer(Permit permit, bool host_pid_namespace)
      : permit_(std::move(permit)), host_pid_namespace_(host_pid_namespace) {}
  void Run();
  void Answer(int fd) const;

  const Permit permit_;
  const bool host_pid_namespace_;
  std::string name_;
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // an eventfd: written by the destructor to end Run
  std::thread thread_;
};

/// The reader's side: asks the exporter serving `socket_name` to admit `pid` (this process's bare
/// tgid) to `key`. OK once admitted; Unavailable when nobody serves the name (the exporter exited,
/// or runs in another network namespace: abstract sockets do not cross them) or it does not answer
/// by `deadline`; the exporter's refusal otherwise (its code and reason).
Status RequestImportPermit(std::string_view socket_name, std::string_view key, std::int32_t pid,
                           Deadline deadline);

}  // namespace kvferry::device
