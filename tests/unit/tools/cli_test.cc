// Runs the kvferry binary as a user would and checks its output and exit status.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

using ::testing::HasSubstr;

struct CliRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

CliRun Cli(const std::string& args) {
  const std::string cmd = std::string(KVFERRY_CLI_PATH) + " " + args + " 2>&1";
  CliRun run;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return run;
  std::array<char, 4096> buf{};
  std::size_t n = 0;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) run.output.append(buf.data(), n);
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kvferry_cli_test_" + std::to_string(getpid()) + "_" + name))
      .string();
}

TEST(CliTest, GenThenCheckThenSelect) {
  const std::string path = TempPath("table.json");
  CliRun gen =
      Cli("ranktable gen --hosts 127.0.0.1 --devices-per-host 4 --prefill 2 --decode 2 -o " + path);
  ASSERT_EQ(gen.exit_code, 0) << gen.output;
  CliRun check = Cli("ranktable check " + path);
  EXPECT_EQ(check.exit_code, 0) << check.output;
  EXPECT_THAT(check.output, HasSubstr("prefill: 2 devices, 127.0.0.1 x2"));
  CliRun sel =
      Cli("ranktable check " + path + " --role kv_consumer --server-id 127.0.0.1 --tp-rank 1");
  EXPECT_EQ(sel.exit_code, 0) << sel.output;
  EXPECT_THAT(sel.output, HasSubstr("device_id 3"));
  CliRun missing =
      Cli("ranktable check " + path + " --role decode --server-id 127.0.0.1 --tp-rank 2");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.output, HasSubstr("NotFound: no decode_device_list entry for TP rank 2"));
  std::filesystem::remove(path);
}

TEST(CliTest, CheckReportsMalformedTables) {
  const std::string path = TempPath("bad.json");
  std::ofstream(path) << R"({"prefill_device_list": [{"server_id": "127.0.0.1"}],
                             "decode_device_list": []})";
  CliRun check = Cli("ranktable check " + path);
  EXPECT_EQ(check.exit_code, 1);
  EXPECT_THAT(check.output, HasSubstr(path + ": prefill_device_list[0].device_id: missing"));
  std::filesystem::remove(path);
}

TEST(CliTest, GenWritesTheReferenceFormatToStdout) {
  CliRun gen =
      Cli("ranktable gen --hosts 127.0.0.1 --devices-per-host 2 --prefill 1 --decode 1 "
          "--super-pod");
  ASSERT_EQ(gen.exit_code, 0) << gen.output;
  EXPECT_THAT(gen.output, HasSubstr("\"super_device_id\": \"1\""));
  EXPECT_THAT(gen.output, HasSubstr("\"status\": \"completed\""));
  CliRun bad = Cli("ranktable gen --hosts 127.0.0.1 --devices-per-host 1 --prefill 1 --decode 1");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("exceed the 1 devices"));
}

TEST(CliTest, PlanShowsReadersAndRuns) {
  CliRun plan =
      Cli("plan --kind mla --layers 2 --prefill-tp 2 --decode-tp 4 "
          "--remote-blocks 5,6,7,9 --local-blocks 1,2,3");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_THAT(plan.output, HasSubstr("prefill rank 0 frees after 2 readers"));
  EXPECT_THAT(plan.output, HasSubstr("blocks: 3 in 2 runs [6->1 x2] [9->3 x1]"));
  EXPECT_THAT(plan.output, HasSubstr("decode rank 3 reads prefill rank 1"));
  // Token-major head slices: a piece per token slot (16), strided on the prefill side.
  CliRun strided =
      Cli("plan --kind mha --kv-heads 8 --prefill-tp 2 --decode-tp 4 --remote-blocks 1");
  EXPECT_EQ(strided.exit_code, 0) << strided.output;
  EXPECT_THAT(strided.output, HasSubstr("k bytes [256, +256) -> [0, +256) x16 (steps 512 -> 256)"));
  EXPECT_THAT(strided.output, HasSubstr("16 reads of 256 pieces, 65536 bytes"));
  CliRun refused =
      Cli("plan --kind mha --kv-heads 8 --prefill-tp 3 --decode-tp 4 --remote-blocks 1");
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_THAT(refused.output, HasSubstr("cannot be split across TP size 3"));
  CliRun sliced =
      Cli("plan --kind mha --kv-heads 8 --layout head_major --prefill-tp 2 --decode-tp 4 "
          "--remote-blocks 1");
  EXPECT_EQ(sliced.exit_code, 0) << sliced.output;
}

TEST(CliTest, UnknownCommandIsAUsageError) {
  CliRun run = Cli("frobnicate");
  EXPECT_NE(run.exit_code, 0);
}

}  // namespace
