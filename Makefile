# kvferry: the two commands that matter are `make demo` and `make test`.
# Every target installs missing Debian packages first (make deps), so a fresh machine needs
# nothing else.

JOBS        ?= $(shell nproc)
BUILD       ?= build
ASAN_BUILD  ?= build-asan
TSAN_BUILD  ?= build-tsan
FUZZ_BUILD  ?= build-fuzz
TSA_BUILD   ?= build-tsa
FUZZ_SECONDS ?= 60
FUZZ_TARGETS = wire_decode ranktable_parse tcp_frames descriptor_decode
PREFIX      ?= /usr/local
CTEST_ARGS  ?=
# full, or lines (-g1: line tables only; builds about a quarter faster, sanitizer reports and
# backtraces keep their file:line). .ci/run sets lines; it applies when a build is configured.
DEBUG_INFO  ?= full
CMAKE_CONFIGURE = cmake -S . -DKVFERRY_DEBUG_INFO=$(DEBUG_INFO)
SOURCES      = $(shell git ls-files '*.cc' '*.h' 2>/dev/null || find include src tools tests fuzz -name '*.cc' -o -name '*.h')

.PHONY: all deps configure build test test-gpu test-npu device-bundle netns soak asan tsan tsa fuzz format format-check tidy install demo clean

all: build

deps:
	@bash scripts/deps.sh

# The main build and the ASan and TSan builds unity-build the libraries, the CLI and the test
# binaries (KVFERRY_UNITY: about half the time of a fresh build); the TSA and fuzz builds compile
# every source on its own (the analysis and the fuzz targets want single files).
$(BUILD)/CMakeCache.txt: | deps
	$(CMAKE_CONFIGURE) -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVFERRY_UNITY=ON

configure: deps $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) $(CTEST_ARGS)

# The device tests with the cuda device on a real GPU (docs/device.md): the probe opens cuda:0;
# without a driver or GPU it prints "no CUDA driver/device: ..." and the recipe exits 77 (make
# itself then exits 2; scripts/gpu_check.sh exits 77), or 1 when KVFERRY_REQUIRE_GPU=1. With a GPU,
# the device tests run with KVFERRY_REQUIRE_GPU=1, so a GPU test cannot skip.
DEVICE_TARGETS = device_ipc_peer device_test cuda_header_check_test cuda_gpu_test device_transport_test \
  kvferry_cli fake_libcuda cuda_fake_driver_test fake_libascendcl fake_libascendcl_old acl_device_test \
  acl_transport_test acl_npu_test acl_header_check_test device_transfer_check
test-gpu: configure
	cmake --build $(BUILD) -j $(JOBS) --target $(DEVICE_TARGETS)
	@$(BUILD)/tests/device_ipc_peer probe; rc=$$?; \
	if [ $$rc -eq 77 ]; then \
	  if [ "$$KVFERRY_REQUIRE_GPU" = 1 ]; then echo "test-gpu: KVFERRY_REQUIRE_GPU=1 but no GPU was found"; exit 1; fi; \
	  exit 77; \
	fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	KVFERRY_REQUIRE_GPU=1 ctest --test-dir $(BUILD) --output-on-failure -L device $(CTEST_ARGS)

# The acl device's tests on a real Ascend NPU (docs/device.md, "Running the NPU check"), as
# test-gpu: the probe opens npu:0 (without CANN or an NPU it prints "no NPU runtime/device: ..."
# and the recipe exits 77, or 1 when KVFERRY_REQUIRE_NPU=1); with one, the tests labelled
# device-npu run with KVFERRY_REQUIRE_NPU=1, so none can skip. scripts/npu_check.sh adds the
# two-process transfer check.
NPU_TARGETS = device_ipc_peer acl_npu_test device_transfer_check
test-npu: configure
	cmake --build $(BUILD) -j $(JOBS) --target $(NPU_TARGETS)
	@$(BUILD)/tests/device_ipc_peer probe npu:0; rc=$$?; \
	if [ $$rc -eq 77 ]; then \
	  if [ "$$KVFERRY_REQUIRE_NPU" = 1 ]; then echo "test-npu: KVFERRY_REQUIRE_NPU=1 but no NPU was found"; exit 1; fi; \
	  exit 77; \
	fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	KVFERRY_REQUIRE_NPU=1 ctest --test-dir $(BUILD) --output-on-failure -L device-npu $(CTEST_ARGS)

# One folder, $(BUILD)/device-bundle (under 64 MiB), with the CLI, the device tests, their helpers
# and the shared libraries they need, for a GPU or NPU machine without kvferry's libraries
# (scripts/device_bundle.sh; docs/device.md, "The device bundle"). There:
# BUNDLE=<folder> scripts/gpu_check.sh, or scripts/npu_check.sh, builds nothing.
device-bundle: configure
	JOBS=$(JOBS) scripts/device_bundle.sh --build-dir $(BUILD)

# Only the two-host tests in network namespaces with faults (also part of make test; they need
# root and are skipped where namespaces cannot be made).
netns: build
	ctest --test-dir $(BUILD) --output-on-failure -L netns $(CTEST_ARGS)

# A longer soak than the one in make test: SOAK_REQUESTS requests, a third abandoned by the client.
SOAK_REQUESTS ?= 10000
soak: configure
	cmake --build $(BUILD) -j $(JOBS) --target kvferry_cli
	$(BUILD)/kvferry demo --requests $(SOAK_REQUESTS) --abort-rate 0.3 --min-prompt 16 \
	  --max-prompt 2048 --num-blocks 2048 --hold-lease-ms 2000 --no-progress

# The same tests under AddressSanitizer and UndefinedBehaviorSanitizer.
# intercept_tls_get_addr=0: GCC 12's runtime misreads some dynamic TLS blocks (those of libraries
# loaded with dlopen, such as UCX's) as carrying a header glibc dropped in 2.25, and the leak check
# at exit then faults ("Tracer caught signal 11"), by chance, after every test passed. The test
# asan_dynamic_tls_at_exit (tests/unit/sanitizer/dtls_exit.cc) makes that chance certain and fails
# without the option. With it, pointers held only in such blocks are not leak-check roots.
asan: deps
	$(CMAKE_CONFIGURE) -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKVFERRY_SANITIZE=address,undefined -DKVFERRY_UNITY=ON
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:intercept_tls_get_addr=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --test-dir $(ASAN_BUILD) --output-on-failure -j $(JOBS) -LE netns $(CTEST_ARGS)

# The same tests under ThreadSanitizer (suppressions, if any, in tsan.supp with a reason each).
# The demo and soak tests (labels demo, soak) are left out: they run three TSan-instrumented
# processes whose reports come from the uninstrumented libzmq and libstdc++ stream code, and every
# library piece they exercise is already covered here by the unit and integration tests.
# UCX_MEM_MMAP_HOOK_MODE=none: UCX (loaded by the ucx tests) patches mmap/munmap in the process to
# track memory, which collides with ThreadSanitizer's own interception of them (every test that
# loads UCX died with SIGSEGV); the ucx backend registers its memory explicitly and needs no hooks.
# No TSan suppression names UCX: with ignore_noninstrumented_modules its frames report nothing.
tsan: deps
	$(CMAKE_CONFIGURE) -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKVFERRY_SANITIZE=thread -DKVFERRY_UNITY=ON
	cmake --build $(TSAN_BUILD) -j $(JOBS)
	UCX_MEM_MMAP_HOOK_MODE=none TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1 suppressions=$(CURDIR)/tsan.supp" \
	  ctest --test-dir $(TSAN_BUILD) --output-on-failure -j $(JOBS) -LE "demo|netns|soak" $(CTEST_ARGS)

# Clang's thread-safety analysis (docs/reliability.md, "Checked locking"): the libraries, the CLI
# and the Python module compiled with clang++ and -Wthread-safety, its findings errors, so a member
# marked GUARDED_BY read or written without its mutex fails the build. The tests are not built;
# nothing runs. -Werror=thread-safety is for the Python module, which does not take the project's
# warning flags (kvferry_warnings, -Werror included, holds for everything else). The analysis runs
# while clang checks each translation unit, before code generation, so each is only checked
# (-fsyntax-only, scripts/syntax_only.py over compile_commands.json): nothing is built or linked.
tsa: deps
	CC=clang CXX=clang++ $(CMAKE_CONFIGURE) -B $(TSA_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKVFERRY_BUILD_TESTS=OFF \
	  -DKVFERRY_DEBUG_INFO=full -DCMAKE_CXX_FLAGS_DEBUG=-O0 \
	  -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror=thread-safety"
	python3 scripts/syntax_only.py $(TSA_BUILD)/compile_commands.json $(JOBS)

# libFuzzer targets built with clang at -O1 (libFuzzer's own recommendation; faster to build than
# -O2), each run for FUZZ_SECONDS from the committed seeds, JOBS of them at a time (each fuzzer is
# one process on one core). A crash leaves its input in
# $(FUZZ_BUILD)/findings/ and fails the target. Only the targets and the libraries they link are
# built (not the CLI, the engine or the control library).
fuzz: deps
	CC=clang CXX=clang++ $(CMAKE_CONFIGURE) -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVFERRY_FUZZ=ON \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g -DNDEBUG"
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target $(addprefix fuzz_,$(FUZZ_TARGETS))
	@mkdir -p $(FUZZ_BUILD)/findings
	@printf '%s\n' $(FUZZ_TARGETS) | xargs -P $(JOBS) -I{} sh -c '\
	  mkdir -p $(FUZZ_BUILD)/corpus/{}; \
	  $(FUZZ_BUILD)/fuzz_{} -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -rss_limit_mb=2048 \
	    -timeout=10 -print_final_stats=1 -artifact_prefix=$(FUZZ_BUILD)/findings/{}- \
	    $(FUZZ_BUILD)/corpus/{} fuzz/seeds/{} 2>$(FUZZ_BUILD)/fuzz_{}.log \
	    || { tail -40 $(FUZZ_BUILD)/fuzz_{}.log; echo "fuzz_{}: FAILED"; exit 1; }; \
	  echo "fuzz_{}: $(FUZZ_SECONDS) s" \
	    $$(grep -E "stat::number_of_executed_units|stat::peak_rss_mb" $(FUZZ_BUILD)/fuzz_{}.log)'

format:
	clang-format -i $(SOURCES)

format-check:
	@clang-format --dry-run --Werror $(SOURCES) && echo "format-check: clean"

tidy: build
	clang-tidy -p $(BUILD) --quiet $(filter %.cc,$(filter src/% tools/%,$(SOURCES)))

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# The end-to-end demo: prefill and decode instances (TP 2 each) moving real KV bytes, verified.
# The demo needs only the CLI (it starts its instances as `kvferry serve` children): building
# the tests too took a fresh machine's first `make demo` past seven minutes.
# A build the demo configures first has line tables only (-g1): about a quarter faster to build.
demo soak: DEBUG_INFO = lines
demo: configure
	cmake --build $(BUILD) -j $(JOBS) --target kvferry_cli
	$(BUILD)/kvferry demo $(DEMO_ARGS)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD) $(TSA_BUILD)
