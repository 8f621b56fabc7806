// The kvferry serve control socket under hostile input (issue 11): every malformed, mistyped,
// unsigned, forged or replayed message gets a signed error reply (or changes nothing), the
// process never dies, and the socket binds to loopback unless told otherwise.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/ports.h"
#include "common/subprocess.h"
#include "sidechannel/auth.h"
#include "sidechannel/zmq_util.h"
#include "tools/control_client.h"
#include "tools/engine_protocol.h"

namespace kvferry::cli {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;
using sidechannel::AuthKind;
using sidechannel::AuthNonce;
using std::chrono::milliseconds;

constexpr char kSecret[] = "serve-control-test-secret";
constexpr int kNumBlocks = 64;  // with 16 tokens per block: prompts of at most 1024 tokens
constexpr milliseconds kReplyTimeout{10000};

std::span<const std::uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

// A kvferry serve instance (prefill, TP 1, a small cache) and its control endpoint.
struct Instance {
  std::optional<Subprocess> process;
  std::string endpoint;  // from the READY line
};

Result<Instance> StartServe(const std::vector<std::string>& extra, const std::string& secret,
                            bool exit_on_stdin_eof = true) {
  const int base = FreeLoopbackPorts(1);
  if (base == 0) return Status::Unavailable("no free port for the side channel");
  std::vector<std::string> argv = {KVFERRY_CLI_PATH, "serve",
                                   "--role",         "prefill",
                                   "--base-port",    std::to_string(base),
                                   "--control-port", "0",
                                   "--num-blocks",   std::to_string(kNumBlocks),
                                   "--layers",       "2"};
  if (exit_on_stdin_eof) argv.push_back("--exit-on-stdin-eof");
  argv.insert(argv.end(), extra.begin(), extra.end());
  // Always set: an empty value means no secret, whatever this process's environment holds.
  KVFERRY_ASSIGN_OR_RETURN(Subprocess p, Subprocess::Spawn(argv, {"KVFERRY_SECRET=" + secret}));
  KVFERRY_ASSIGN_OR_RETURN(std::string line, p.ReadLine(milliseconds(60000)));
  if (line.rfind("READY ", 0) != 0) return Status::Internal("serve did not start: " + line);
  Instance out;
  out.endpoint = line.substr(6);
  out.process = std::move(p);
  return out;
}

// A raw DEALER connection that sends whatever frames a test makes up.
class RawPeer {
 public:
  explicit RawPeer(const std::string& endpoint) : socket_(ZMQ_DEALER) {
    (void)socket_.SetInt(ZMQ_SNDTIMEO, 5000);
    zmq_connect(socket_.get(), endpoint.c_str());
  }
  void SendFrames(const std::vector<std::vector<std::uint8_t>>& frames) {
    std::vector<std::span<const std::uint8_t>> spans(frames.begin(), frames.end());
    ASSERT_TRUE(sidechannel::SendFrames(socket_.get(), spans).ok());
  }
  // Signs `body` with `secret` (fresh nonce, now) and sends it; returns the nonce.
  AuthNonce SendSigned(const std::string& body, const std::string& secret) {
    AuthNonce nonce{};
    const std::vector<std::uint8_t> header =
        sidechannel::SignMessage(secret, AuthKind::kRequest, Bytes(body), AuthNonce{}, &nonce);
    SendFrames({header, {body.begin(), body.end()}});
    return nonce;
  }
  // The next reply within the deadline, verified under the instance's secret and bound to
  // `nonce`; an error if none comes or it does not verify.
  Result<Json> Reply(const AuthNonce& nonce) {
    const Deadline deadline = DeadlineAfter(kReplyTimeout);
    while (!Expired(deadline)) {
      zmq_pollitem_t item{socket_.get(), 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, PollTimeoutMs(deadline, 100)) <= 0) continue;
      std::vector<std::vector<std::uint8_t>> frames;
      bool truncated = false;
      KVFERRY_RETURN_IF_ERROR(
          sidechannel::RecvFrames(socket_.get(), &frames, 2, 64 << 20, &truncated));
      if (frames.size() != 2)
        return Status::Internal("reply of " + std::to_string(frames.size()) +
                                " frames; expected 2");
      KVFERRY_RETURN_IF_ERROR(sidechannel::VerifyMessage(kSecret, AuthKind::kReply, frames[0],
                                                         frames[1], nonce, kControlMaxClockSkew)
                                  .status());
      Json j = Json::parse(frames[1].begin(), frames[1].end(), nullptr, false);
      if (!j.is_object()) return Status::Internal("reply is not a JSON object");
      if (j.value("request_nonce", std::string()) != NonceHex(nonce)) {
        return Status::Internal("reply names another request's nonce");
      }
      return j;
    }
    return Status::Timeout("no reply within the deadline");
  }

 private:
  sidechannel::ZmqSocket socket_;
};

class ServeControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<Instance> i = StartServe({}, kSecret);
    ASSERT_TRUE(i.ok()) << i.status().ToString();
    instance_ = std::move(i).value();
    client_.emplace(instance_.endpoint, kSecret);
    raw_.emplace(instance_.endpoint);
  }

  // The instance still answers a valid, signed stats request.
  void ExpectServing() {
    Result<Json> stats = client_->Call({{"op", "stats"}}, kReplyTimeout);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    EXPECT_EQ(stats->value("ok", false), true) << stats->dump();
    EXPECT_TRUE(stats->contains("used_blocks")) << stats->dump();
  }

  // Sends `body` signed with the secret; expects a refusal with `code` whose error contains
  // `error_part`, and that the instance still serves.
  Json ExpectRefused(const std::string& body, const std::string& error_part,
                     const std::string& code = "InvalidArgument") {
    SCOPED_TRACE(body.substr(0, 200));
    const AuthNonce nonce = raw_->SendSigned(body, kSecret);
    Result<Json> r = raw_->Reply(nonce);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return Json();
    EXPECT_EQ(r->value("ok", true), false) << r->dump();
    EXPECT_EQ(r->value("code", std::string()), code) << r->dump();
    EXPECT_THAT(r->value("error", std::string()), HasSubstr(error_part)) << r->dump();
    ExpectServing();
    return *r;
  }

  Instance instance_;
  std::optional<ControlClient> client_;
  std::optional<RawPeer> raw_;
};

TEST_F(ServeControlTest, TheAuditsMessagesGetErrorRepliesNamingTheField) {
  Json r = ExpectRefused(R"({"op":5})", "op: expected one of");
  EXPECT_THAT(r.value("error", std::string()), HasSubstr("found number 5"));
  r = ExpectRefused(R"({"op":"abort","request_id":{}})", "request_id: expected a non-empty string");
  EXPECT_THAT(r.value("error", std::string()), HasSubstr("found object"));
  EXPECT_EQ(r.value("op", std::string()), "abort");
  r = ExpectRefused(R"({"op":"generate","request_id":"r1","prompt":"hello"})",
                    "prompt: expected a non-empty array");
  EXPECT_EQ(r.value("request_id", std::string()), "r1") << "generate refusals name the request";
  r = ExpectRefused(
      R"({"op":"generate","request_id":"r2","prompt":[1,2],"kv_transfer_params":{"do_remote_prefill":"yes"}})",
      "kv_transfer_params.do_remote_prefill: expected a boolean (true or false), found string "
      "\"yes\"");
  EXPECT_EQ(r.value("request_id", std::string()), "r2");
}

TEST_F(ServeControlTest, NonObjectsAndUnknownOpsAreRefused) {
  for (const char* body : {"[1,2]", "\"generate\"", "null", "42", "true"}) {
    ExpectRefused(body, "message: expected a JSON object");
  }
  ExpectRefused("{", "not JSON");
  ExpectRefused("{\"op\":\"stats\",\"x\":\"\xff\xfe\"}", "not JSON (or not UTF-8)");
  ExpectRefused("", "not JSON");
  ExpectRefused("{}", "op: missing");
  ExpectRefused(R"({"op":"reboot"})", "found string \"reboot\"");
  ExpectRefused(R"({"op":null})", "op: expected one of");
  ExpectRefused(R"({"op":["stats"]})", "found array");
  // Nesting deeper than any recursive parser's stack.
  ExpectRefused(R"({"op":"generate","request_id":"deep","prompt":[1],"kv_transfer_params":)" +
                    std::string(100000, '[') + std::string(100000, ']') + "}",
                "kv_transfer_params: expected a JSON object, found array");
}

TEST_F(ServeControlTest, EveryFieldIsTypeChecked) {
  const std::string g = R"({"op":"generate","request_id":"t","prompt":)";
  ExpectRefused(R"({"op":"generate","prompt":[1]})", "request_id: missing");
  ExpectRefused(R"({"op":"generate","request_id":7,"prompt":[1]})", "found number 7");
  ExpectRefused(R"({"op":"abort","request_id":""})", "request_id: expected a non-empty string");
  ExpectRefused(R"({"op":"abort","request_id":")" + std::string(1025, 'x') + "\"}",
                "found 1025 bytes");
  ExpectRefused(R"({"op":"generate","request_id":"t"})", "prompt: missing");
  ExpectRefused(g + "[]}", "prompt: expected a non-empty array");
  ExpectRefused(g + "{}}", "prompt: expected a non-empty array");
  ExpectRefused(g + "[1,1.5]}", "prompt[1]: expected an integer in 0..2147483647, found number");
  ExpectRefused(g + "[-1]}", "prompt[0]: expected an integer in 0..2147483647");
  ExpectRefused(g + "[2147483648]}", "prompt[0]: expected an integer");
  ExpectRefused(g + "[18446744073709551616]}", "prompt[0]: expected an integer");
  ExpectRefused(g + "[1e400]}", "expected");  // nlohmann refuses the overflow while parsing
  ExpectRefused(g + R"([1,"2"]})", "prompt[1]: expected an integer");
  ExpectRefused(g + "[[1]]}", "prompt[0]: expected an integer");
  // More tokens than the cache can ever hold would block every request behind it.
  std::string huge = g + "[";
  for (int i = 0; i < kNumBlocks * 16 + 1; ++i) huge += (i == 0 ? "1" : ",1");
  Json r = ExpectRefused(huge + "]}", "more than this instance's cache can ever hold");
  EXPECT_EQ(r.value("request_id", std::string()), "t");

  const std::string p = g + R"([1,2,3],"kv_transfer_params":)";
  ExpectRefused(p + "[]}", "kv_transfer_params: expected a JSON object, found array");
  ExpectRefused(p + "\"{}\"}", "kv_transfer_params: expected a JSON object, found string");
  ExpectRefused(p + R"({"do_remote_decode":1}})",
                "kv_transfer_params.do_remote_decode: expected a boolean");
  ExpectRefused(p + R"({"remote_block_ids":"1,2"}})",
                "kv_transfer_params.remote_block_ids: expected an array");
  ExpectRefused(p + R"({"remote_block_ids":[1,"2"]}})",
                "kv_transfer_params.remote_block_ids[1]: expected an integer");
  // -1 is kNoBlock (a sliding window's freed block); below it nothing.
  ExpectRefused(p + R"({"remote_block_ids":[-2]}})",
                "kv_transfer_params.remote_block_ids[0]: expected an integer");
  ExpectRefused(p + R"({"remote_engine_id":5}})",
                "kv_transfer_params.remote_engine_id: expected a non-empty string");
  ExpectRefused(p + R"({"remote_host":[]}})",
                "kv_transfer_params.remote_host: expected a non-empty string");
  ExpectRefused(p + R"({"remote_request_id":{}}})",
                "kv_transfer_params.remote_request_id: expected a non-empty string");
  ExpectRefused(p + R"({"remote_port":0}})",
                "kv_transfer_params.remote_port: expected an integer in 1..65535, found number 0");
  ExpectRefused(p + R"({"remote_port":70000}})", "kv_transfer_params.remote_port: expected");
  ExpectRefused(p + R"({"remote_port":"5557"}})", "kv_transfer_params.remote_port: expected");
  ExpectRefused(p + R"({"remote_port":5557.5}})", "kv_transfer_params.remote_port: expected");
  ExpectRefused(p + R"({"remote_tp_size":0}})",
                "kv_transfer_params.remote_tp_size: expected an integer in 1..1024");
  ExpectRefused(p + R"({"remote_tp_size":2000000000}})",
                "kv_transfer_params.remote_tp_size: expected an integer in 1..1024");
  ExpectRefused(p + R"({"remote_tp_size":true}})", "found boolean true");
  ExpectRefused(p + R"({"remote_port":65535,"remote_tp_size":2}})", "expected at most 65535");
}

TEST_F(ServeControlTest, ValidRequestsStillWork) {
  // null counts as absent, unknown fields are ignored.
  const AuthNonce nonce = raw_->SendSigned(
      R"({"op":"generate","request_id":"good","prompt":[1,2,3],"future_field":1,)"
      R"("kv_transfer_params":{"do_remote_decode":false,"remote_host":null,"x":[]}})",
      kSecret);
  Result<Json> r = raw_->Reply(nonce);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->value("request_id", std::string()), "good");
  EXPECT_EQ(r->value("ok", false), true) << r->dump();
  ExpectServing();
}

TEST_F(ServeControlTest, UnauthenticatedMessagesChangeNothing) {
  const std::string shutdown = R"({"op":"shutdown"})";
  // Unsigned: the body alone.
  raw_->SendFrames({{shutdown.begin(), shutdown.end()}});
  Result<Json> r = raw_->Reply(AuthNonce{});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->value("code", std::string()), "InvalidArgument");
  EXPECT_THAT(r->value("error", std::string()), HasSubstr("[authentication header][JSON]"));
  ExpectServing();

  // Without the secret (an empty key), and with another secret.
  for (const std::string& secret : {std::string(), std::string("guessed")}) {
    const AuthNonce nonce = raw_->SendSigned(shutdown, secret);
    r = raw_->Reply(nonce);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->value("code", std::string()), "Unauthenticated");
    EXPECT_THAT(r->value("error", std::string()), HasSubstr("authentication failed"));
    ExpectServing();
  }

  // A valid header for another body (the body was altered).
  AuthNonce nonce{};
  const std::string stats = R"({"op":"stats"})";
  std::vector<std::uint8_t> header =
      sidechannel::SignMessage(kSecret, AuthKind::kRequest, Bytes(stats), AuthNonce{}, &nonce);
  raw_->SendFrames({header, {shutdown.begin(), shutdown.end()}});
  r = raw_->Reply(nonce);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->value("code", std::string()), "Unauthenticated");
  ExpectServing();

  // A header of the wrong size; a stale timestamp; too many frames.
  raw_->SendFrames({{1, 2, 3}, {shutdown.begin(), shutdown.end()}});
  r = raw_->Reply(AuthNonce{});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_THAT(r->value("error", std::string()), HasSubstr("authentication header of 3 bytes"));
  nonce.fill(7);
  header = sidechannel::SignMessageAt(kSecret, AuthKind::kRequest, Bytes(shutdown), AuthNonce{},
                                      sidechannel::UnixMillis() - 120000, nonce);
  raw_->SendFrames({header, {shutdown.begin(), shutdown.end()}});
  r = raw_->Reply(nonce);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_THAT(r->value("error", std::string()), HasSubstr("stale or replayed"));
  raw_->SendFrames({header, {shutdown.begin(), shutdown.end()}, {1}});
  r = raw_->Reply(nonce);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->value("code", std::string()), "ResourceExhausted");
  ExpectServing();

  // A captured valid message, replayed.
  header = sidechannel::SignMessage(kSecret, AuthKind::kRequest, Bytes(stats), AuthNonce{}, &nonce);
  raw_->SendFrames({header, {stats.begin(), stats.end()}});
  r = raw_->Reply(nonce);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->value("ok", false), true) << r->dump();
  raw_->SendFrames({header, {stats.begin(), stats.end()}});
  r = raw_->Reply(nonce);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->value("code", std::string()), "Unauthenticated");
  EXPECT_THAT(r->value("error", std::string()), HasSubstr("replayed message"));
  // The same nonce signed again under a later timestamp (a valid MAC): a nonce is accepted once,
  // whatever its timestamp (docs/control.md).
  header = sidechannel::SignMessageAt(kSecret, AuthKind::kRequest, Bytes(stats), AuthNonce{},
                                      sidechannel::UnixMillis() + 1000, nonce);
  raw_->SendFrames({header, {stats.begin(), stats.end()}});
  r = raw_->Reply(nonce);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->value("code", std::string()), "Unauthenticated") << r->dump();
  EXPECT_THAT(r->value("error", std::string()), HasSubstr("replayed message"));

  // Nothing above shut it down: a signed shutdown does, and it exits 0.
  Result<Json> stats_reply = client_->Call({{"op", "stats"}}, kReplyTimeout);
  ASSERT_TRUE(stats_reply.ok()) << stats_reply.status().ToString();
  EXPECT_EQ(stats_reply->value("control_refused", 0), 9) << stats_reply->dump();
  Result<Json> bye = client_->Call({{"op", "shutdown"}}, kReplyTimeout);
  ASSERT_TRUE(bye.ok()) << bye.status().ToString();
  EXPECT_EQ(bye->value("ok", false), true);
  Result<int> code = instance_.process->CloseAndWait(milliseconds(10000));
  ASSERT_TRUE(code.ok()) << code.status().ToString();
  EXPECT_EQ(*code, 0);
}

TEST_F(ServeControlTest, TheProxyDropsRepliesSignedWithAnotherSecret) {
  ControlClient wrong(instance_.endpoint, "not-the-secret");
  Result<Json> r = wrong.Call({{"op", "stats"}}, milliseconds(2000));
  EXPECT_EQ(r.status().code(), StatusCode::kTimeout) << r.status().ToString();
  EXPECT_EQ(wrong.rejected(), 1u);
  ExpectServing();
}

// True if a TCP connection to host:port is accepted.
bool Connects(const std::string& host, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
  const bool ok = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

TEST(ServeControlBindTest, TheControlSocketBindsToLoopbackByDefault) {
  // The side channel on 127.0.0.2 (a loopback address, so no secret is needed); the control
  // socket stays on 127.0.0.1 all the same.
  Result<Instance> i = StartServe({"--host", "127.0.0.2"}, "");
  ASSERT_TRUE(i.ok()) << i.status().ToString();
  ASSERT_EQ(i->endpoint.rfind("tcp://127.0.0.1:", 0), 0u) << i->endpoint;
  const int port = std::stoi(i->endpoint.substr(i->endpoint.rfind(':') + 1));
  EXPECT_TRUE(Connects("127.0.0.1", port));
  EXPECT_FALSE(Connects("127.0.0.2", port));
  ControlClient client(i->endpoint, "");
  Result<Json> stats = client.Call({{"op", "stats"}}, kReplyTimeout);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->value("ok", false), true);
}

TEST(ServeControlBindTest, ANonLoopbackControlHostNeedsASecret) {
  const std::string cmd = "env -u KVFERRY_SECRET " + std::string(KVFERRY_CLI_PATH) +
                          " serve --role prefill --control-port 0 --control-host 10.1.2.3 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  std::array<char, 4096> buf{};
  std::size_t n = 0;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) output.append(buf.data(), n);
  const int status = pclose(pipe);
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 2) << output;
  EXPECT_THAT(output, HasSubstr("without a secret"));
  EXPECT_THAT(output, HasSubstr("KVFERRY_SECRET"));
}

// Issue 31: a drained instance (the control message "drain", or SIGTERM) takes no new request,
// keeps its holds until they end (here by their lease: no reader comes), then exits 0 by itself.
// The exit is the event waited for; the instance is not told to stop otherwise (no
// --exit-on-stdin-eof, so closing its stdin does nothing).
void HoldThenDrain(bool by_signal) {
  Result<Instance> i = StartServe({"--hold-lease-ms", "1500"}, kSecret, false);
  ASSERT_TRUE(i.ok()) << i.status().ToString();
  ControlClient client(i->endpoint, kSecret);
  Result<Json> held = client.Call({{"op", "generate"},
                                   {"request_id", "held"},
                                   {"prompt", {1, 2, 3, 4, 5}},
                                   {"kv_transfer_params", {{"do_remote_decode", true}}}},
                                  kReplyTimeout);
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  ASSERT_EQ(held->value("ok", false), true) << held->dump();
  if (by_signal) {
    i->process->Signal(SIGTERM);
  } else {  // kvferry drain ENDPOINT
    Result<Subprocess> cli = Subprocess::Spawn({KVFERRY_CLI_PATH, "drain", i->endpoint},
                                               {"KVFERRY_SECRET=" + std::string(kSecret)});
    ASSERT_TRUE(cli.ok()) << cli.status().ToString();
    Result<std::string> line = cli->ReadLine(kReplyTimeout);
    ASSERT_TRUE(line.ok()) << line.status().ToString();
    ASSERT_EQ(line->rfind("draining: ", 0), 0u) << *line;
    const Json d = Json::parse(line->substr(10), nullptr, false);
    EXPECT_EQ(d.value("state", std::string()), "draining") << d.dump();
    EXPECT_EQ(d.value("holds", -1), 1) << d.dump();
    Result<int> cli_code = cli->CloseAndWait(kReplyTimeout);
    ASSERT_TRUE(cli_code.ok() && *cli_code == 0);
  }
  // Draining (the signal is taken within the loop's 20 ms sampling), with the hold kept.
  Json stats;
  for (const Deadline until = DeadlineAfter(kReplyTimeout); !Expired(until);) {
    Result<Json> s = client.Call({{"op", "stats"}}, kReplyTimeout);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    stats = *s;
    if (stats.value("state", std::string()) == "draining") break;
  }
  ASSERT_EQ(stats.value("state", std::string()), "draining") << stats.dump();
  EXPECT_EQ(stats.value("holds", -1), 1) << stats.dump();
  Result<Json> refused =
      client.Call({{"op", "generate"}, {"request_id", "new"}, {"prompt", {1, 2}}}, kReplyTimeout);
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  EXPECT_EQ(refused->value("code", std::string()), "Unavailable") << refused->dump();
  EXPECT_THAT(refused->value("error", std::string()), HasSubstr("draining"));
  Result<int> code = i->process->CloseAndWait(milliseconds(30000));
  ASSERT_TRUE(code.ok()) << "the drained instance did not exit: " << code.status().ToString();
  EXPECT_EQ(*code, 0);
}

TEST(ServeDrainTest, TheDrainMessageKeepsTheHoldsThenExitsZero) { HoldThenDrain(false); }

TEST(ServeDrainTest, SigtermDrainsAndASecondOneEndsTheInstanceAtOnce) {
  HoldThenDrain(true);
  Result<Instance> i = StartServe({"--hold-lease-ms", "60000"}, kSecret, false);
  ASSERT_TRUE(i.ok()) << i.status().ToString();
  ControlClient client(i->endpoint, kSecret);
  Result<Json> held = client.Call({{"op", "generate"},
                                   {"request_id", "held"},
                                   {"prompt", {1, 2, 3}},
                                   {"kv_transfer_params", {{"do_remote_decode", true}}}},
                                  kReplyTimeout);
  ASSERT_TRUE(held.ok() && held->value("ok", false)) << held.status().ToString();
  i->process->Signal(SIGTERM);
  // The second only once the first was taken (two sent at once may arrive as one).
  for (const Deadline until = DeadlineAfter(kReplyTimeout); !Expired(until);) {
    Result<Json> s = client.Call({{"op", "stats"}}, kReplyTimeout);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    if (s->value("state", std::string()) == "draining") break;
  }
  i->process->Signal(SIGTERM);
  Result<int> code = i->process->CloseAndWait(milliseconds(30000));
  ASSERT_TRUE(code.ok()) << code.status().ToString();
  EXPECT_EQ(*code, 128 + SIGTERM);
}
}  // namespace
}  // namespace kvferry::cli
