// kvferry: Status and Result<T>, the one error convention of the library.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvferry {

/// The fixed set of error codes. Callers branch on the code; the message is for people.
/// The numeric values are part of the wire protocol (error replies carry them): never renumber.
enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument = 1,    ///< the caller or a peer passed something malformed or out of range
  kNotFound = 2,           ///< a named thing (request, peer, rank-table entry, file) does not exist
  kUnavailable = 3,        ///< a peer or resource cannot be reached now; retrying may help
  kPeerDisconnected = 4,   ///< a peer that was connected went away mid-operation
  kTimeout = 5,            ///< a deadline passed before the operation completed
  kCancelled = 6,          ///< the operation was cancelled by its owner
  kResourceExhausted = 7,  ///< a bound (memory, queue, count) would be exceeded
  kNotSupported = 8,       ///< a valid request this build or configuration cannot serve
  kInternal = 9,           ///< an invariant of kvferry itself broke: a bug to report
  kUnauthenticated = 10,   ///< a peer failed authentication
};

/// Returns the code's name, e.g. "InvalidArgument". Never null.
const char* StatusCodeName(StatusCode code);

/// Maps a wire value back to a code; values outside the set map to kInternal.
StatusCode StatusCodeFromWire(std::uint64_t value);

/// An outcome: OK, or a code with a message that says what was expected, what was found and
/// what to do. OK holds no allocation, so returning OK is cheap. Copyable and movable; a moved-from
/// Status is OK. Not thread-safe for concurrent mutation (like any value type).
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message);
  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&& other) noexcept = default;
  Status& operator=(Status&& other) noexcept = default;
  ~Status() = default;

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return {StatusCode::kInvalidArgument, std::move(msg)};
  }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }
  static Status PeerDisconnected(std::string msg) {
    return {StatusCode::kPeerDisconnected, std::move(msg)};
  }
  static Status Timeout(std::string msg) { return {StatusCode::kTimeout, std::move(msg)}; }
  static Status Cancelled(std::string msg) { return {StatusCode::kCancelled, std::move(msg)}; }
  static Status ResourceExhausted(std::string msg) {
    return {StatusCode::kResourceExhausted, std::move(msg)};
  }
  static Status NotSupported(std::string msg) {
    return {StatusCode::kNotSupported, std::move(msg)};
  }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status Unauthenticated(std::string msg) {
    return {StatusCode::kUnauthenticated, std::move(msg)};
  }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  /// The message; empty for OK.
  std::string_view message() const;
  /// "OK" or "<CodeName>: <message>".
  std::string ToString() const;

  /// Returns a Status with the same code and `context + ": " + message`. OK stays OK.
  Status WithContext(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct State {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<State> state_;  // null means OK
};

/// Either a value of T or a non-OK Status. Constructing a Result from an OK Status is a bug and
/// yields an Internal error instead, so a Result never claims success without a value.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status)                      // NOLINT(google-explicit-constructor)
      : v_(status.ok() ? Status::Internal("Result constructed from an OK Status without a value")
                       : std::move(status)) {}

  bool ok() const { return std::holds_alternative<T>(v_); }
  /// The error; OK when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

  /// The value. Calling these on an error is a programming error (std::bad_variant_access).
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<Status, T> v_;
};

}  // namespace kvferry

#define KVFERRY_CONCAT_INNER_(a, b) a##b
#define KVFERRY_CONCAT_(a, b) KVFERRY_CONCAT_INNER_(a, b)

/// Evaluates `expr` (a Status); returns it from the enclosing function if it is not OK.
#define KVFERRY_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::kvferry::Status kvferry_status_ = (expr);        \
    if (!kvferry_status_.ok()) return kvferry_status_; \
  } while (false)

/// Evaluates `expr` (a Result<T>); on error returns its Status, else moves the value into `lhs`
/// (a declaration such as `auto x` or an existing variable).
#define KVFERRY_ASSIGN_OR_RETURN(lhs, expr) \
  KVFERRY_ASSIGN_OR_RETURN_IMPL_(KVFERRY_CONCAT_(kvferry_result_, __LINE__), lhs, expr)
// NOLINTBEGIN(bugprone-macro-parentheses): `lhs` may be a declaration, which cannot be
// parenthesised.
#define KVFERRY_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)
