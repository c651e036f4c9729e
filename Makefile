# flashc: the two set-up commands are `make run` and `make test`.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all build run test test-gpu test-install asan tsan test-clang install clean

all: build

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# Builds, then benchmarks the default backend (CUDA when a GPU is there, else CPU).
run: build
	$(BUILD)/flashc bench

# Builds, then runs every test that this machine can run (GPU tests: `make test-gpu`).
# The Python tests (python/tests) and the .npy tests of the flashc command (cli_roundtrip, cli_safety) are registered
# only when the configure step could import numpy (and pytest); when they are not, a banner says so before and
# after the run, since a green run without them tests much less.
PY_SKIP_BANNER = if ! (cd $(BUILD) && ctest -N -R '^python$$' | grep -q 'Total Tests: [1-9]'); then \
	  py=$$(sed -n 's/^_Python3_EXECUTABLE:INTERNAL=//p' $(BUILD)/CMakeCache.txt); \
	  echo "************************************************************************************************"; \
	  echo "make test: the Python tests are SKIPPED (and cli_roundtrip, cli_safety if numpy is missing):"; \
	  echo "  $${py:-no Python 3 interpreter} could not import numpy and pytest when $(BUILD) was configured."; \
	  echo "  Install them ($${py:-python3} -m pip install numpy pytest), then: cmake $(BUILD) && make test"; \
	  echo "************************************************************************************************"; \
	fi
test: build
	@$(PY_SKIP_BANNER)
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE gpu; rc=$$?; cd $(CURDIR) && $(PY_SKIP_BANNER); exit $$rc

test-gpu: build
	cd $(BUILD) && ctest --output-on-failure -L gpu

# The CPU test suite under AddressSanitizer and UBSan, then the seeded API and .npy fuzz drivers
# (tests/fuzz_api.c, tests/fuzz_npy.c) on seed FUZZ_SEED for a fixed number of cases per kernel set (FUZZ_API_RUNS,
# FUZZ_NPY_RUNS: the same cases on any machine; about a minute each here), FUZZ_SECONDS at most (ctest ran seed 1);
# a driver not built yet is skipped. A failure prints the seed and case: `make asan FUZZ_SEED=<it>` reruns it.
FUZZ_SEED ?= 2
FUZZ_API_RUNS ?= 2500
FUZZ_NPY_RUNS ?= 150000
FUZZ_SECONDS ?= 600
ASAN_ENV = ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
asan:
	cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DFLASHC_SANITIZE=ON -DFLASHC_CUDA=off
	cmake --build $(BUILD)-asan -j $(JOBS)
	cd $(BUILD)-asan && $(ASAN_ENV) ctest --output-on-failure -j $(JOBS) -LE "gpu|python"
	@failed=; for fz in fuzz_api fuzz_npy; do \
	  exe=$(BUILD)-asan/tests/$$fz; \
	  if test -x $$exe; then \
	    runs=$$(test $$fz = fuzz_api && echo $(FUZZ_API_RUNS) || echo $(FUZZ_NPY_RUNS)); \
	    echo "== asan: $$exe --seed $(FUZZ_SEED) --runs $$runs --seconds $(FUZZ_SECONDS)"; \
	    $(ASAN_ENV) $$exe --seed $(FUZZ_SEED) --runs $$runs --seconds $(FUZZ_SECONDS) || failed="$$failed $$fz"; \
	  else echo "asan: $$exe not built (tests/$$fz.c missing), skipped"; fi; \
	done; \
	if test -n "$$failed"; then echo "asan: failed:$$failed (seed $(FUZZ_SEED))"; exit 1; fi

# ThreadSanitizer on tests/test_threads.c: user threads sharing contexts, first calls racing (RelWithDebInfo, CPU).
# OpenMP under TSan: GCC's libgomp is not instrumented, so its barriers are invisible to TSan and every OpenMP
# region reports false races (hundreds, and minutes spent symbolizing them). So the build uses clang with LLVM's
# libomp and runs the test with Archer (libarcher.so, LLVM's OpenMP tool that tells TSan about OpenMP's
# synchronization; Debian ships it in libomp-14-dev): then the library's own OpenMP regions are checked too, at 2
# threads per call. The suppressions file, written into the build directory, holds one line,
# called_from_lib:libomp.so.5: libomp's internal malloc/free/memset/mutex calls (its own per-thread allocator, which
# reuses memory across threads without TSan seeing why that is safe - reported even at 1 thread per call) are not
# reported; a race in flashc's code is still reported, also inside its parallel regions (a report's first frames
# then name flashc code). The test runs first at 1 thread per call, where the only concurrency is between the
# test's pthreads, then at 2. Where clang, libomp or Archer is missing (TSAN_CC=gcc, say), only the 1-thread run
# is made: with libgomp a region of 1 thread starts no OpenMP thread, so TSan sees no libgomp internals.
# Kernels with vm.mmap_rnd_bits > 28 break the TSan of clang 14 / gcc 12 ("unexpected memory mapping"): there the
# test runs with address randomization off (setarch -R).
TSAN_CC ?= $(if $(shell command -v clang 2>/dev/null),clang,cc)
TSAN_BASE = TSAN_OPTIONS="halt_on_error=0:second_deadlock_stack=1:external_symbolizer_path=$$sym$$supp"
tsan:
	cmake -S . -B $(BUILD)-tsan -DCMAKE_C_COMPILER=$(TSAN_CC) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DFLASHC_SANITIZE=thread -DFLASHC_CUDA=off -DFLASHC_BUILD_TOOLS=OFF
	cmake --build $(BUILD)-tsan -j $(JOBS) --target test_threads
	@cd $(BUILD)-tsan && \
	sym=$$($(TSAN_CC) -print-prog-name=llvm-symbolizer); test -x "$$sym" || sym=$$(command -v llvm-symbolizer || true); \
	omp=$$(ldd tests/test_threads | awk '/libomp\.so/ {print $$3; exit}'); \
	archer=$${omp:+$$(dirname "$$omp")/libarcher.so}; \
	norand=; if test "$$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 0)" -gt 28 && \
	  setarch "$$(uname -m)" -R true 2>/dev/null; then norand="setarch $$(uname -m) -R"; fi; \
	supp=; if test -n "$$omp"; then \
	  printf 'called_from_lib:%s\n' "$$(basename $$omp)" > libomp.supp; supp=:suppressions=$$PWD/libomp.supp; fi; \
	echo "== tsan: 1 library thread per call"; \
	FLASHC_TEST_OMP_THREADS=1 $(TSAN_BASE) $$norand ctest --output-on-failure -R '^test_threads$$' || exit 1; \
	if test -n "$$omp" && test -f "$$archer"; then \
	  echo "== tsan: 2 library threads per call (libomp + Archer: $$archer)"; \
	  FLASHC_TEST_OMP_THREADS=2 OMP_TOOL_LIBRARIES=$$archer $(TSAN_BASE) \
	    $$norand ctest --output-on-failure -R '^test_threads$$' || exit 1; \
	else echo "tsan: no libomp + libarcher.so (TSAN_CC=$(TSAN_CC)): OpenMP regions not checked, 1 thread per call only"; fi

# The CPU build and tests with clang (CI builds with both gcc and clang), under clang's AddressSanitizer and UBSan:
# clang's UBSan reports pointer overflow that gcc's let through (the microkernels' unsigned stride products, found by
# libFuzzer); Debug (-O0): clang -O2 with the sanitizers spends over ten minutes on the AVX-512 microkernels. LLVM's
# libomp keeps its thread pool's memory to the end, which LeakSanitizer reports as a leak of
# libomp's own: that one library's allocations are suppressed, nothing of flashc's. The Python tests are left to
# `make test`.
CLANG ?= clang
test-clang:
	cmake -S . -B $(BUILD)-clang -DCMAKE_C_COMPILER=$(CLANG) -DCMAKE_BUILD_TYPE=Debug -DFLASHC_SANITIZE=ON \
	  -DFLASHC_CUDA=off
	cmake --build $(BUILD)-clang -j $(JOBS) > $(BUILD)-clang/build.log 2>&1; rc=$$?; cat $(BUILD)-clang/build.log; \
	  n=$$(grep -c ': warning:' $(BUILD)-clang/build.log || true); echo "clang: $$n warnings"; \
	  grep ': warning:' $(BUILD)-clang/build.log | sort -u || true; exit $$rc
	echo "leak:libomp.so" > $(BUILD)-clang/lsan.supp
	cd $(BUILD)-clang && LSAN_OPTIONS=suppressions=$$PWD/lsan.supp $(ASAN_ENV) ctest --output-on-failure -j $(JOBS) -LE "gpu|python"

# Installs the build into a temporary prefix and links a program from outside the tree against it, as README.md's
# "Installing" section shows: pkg-config (shared, and --static), find_package(flashc) (flashc::flashc,
# flashc::flashc_static). With the CUDA backend built this checks the static library's CUDA runtime dependency;
# no GPU is needed (the program runs a CPU attention).
test-install: build
	cmake/install-test/run.sh $(BUILD)

install: build
	cmake --install $(BUILD) $(if $(PREFIX),--prefix $(PREFIX),)

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-tsan $(BUILD)-clang
