if(TARGET dp_bench)
  dp_add_test(test_bench SOURCES test_bench.cpp LIBS dp_bench_report dp_distributed)
  target_compile_definitions(test_bench PRIVATE DP_BENCH_BUILT="$<TARGET_FILE:dp_bench>")
  add_dependencies(test_bench dp_bench)
endif()

# scripts/gpu_check.sh on a machine without a GPU: exit 2 at once, one line (skipped with a GPU).
add_test(NAME "bench.gpu_check: exits 2 without a GPU"
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/gpu_check_no_gpu.sh
                 ${PROJECT_SOURCE_DIR}/scripts/gpu_check.sh ${CMAKE_BINARY_DIR})
set_tests_properties("bench.gpu_check: exits 2 without a GPU"
                     PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 60)
# The lease plan's bash, run on CPU devices with a stand-in nvidia-smi (skipped with a GPU).
add_test(NAME "bench.gpu_check: a dry run of the lease on CPU devices packs every part, cuts at the deadline"
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/gpu_check_dry_run.sh
                 ${PROJECT_SOURCE_DIR}/scripts/gpu_check.sh ${CMAKE_BINARY_DIR})
set_tests_properties("bench.gpu_check: a dry run of the lease on CPU devices packs every part, cuts at the deadline"
                     PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300)
add_test(NAME "bench.gpu_check: finds the CUDA libraries of PyTorch's wheels"
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/gpu_check_libs.sh
                 ${PROJECT_SOURCE_DIR}/scripts/gpu_check.sh)
set_tests_properties("bench.gpu_check: finds the CUDA libraries of PyTorch's wheels"
                     PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 60)

add_test(NAME "bench.gpu_check: the bundle's tar.xz unpacks with python3 alone, bad files exit 2"
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/unpack_bundle_test.sh
                 ${PROJECT_SOURCE_DIR}/scripts/unpack_bundle.py)
set_tests_properties("bench.gpu_check: the bundle's tar.xz unpacks with python3 alone, bad files exit 2"
                     PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 60)

# bench_collectives checks its flags before any work, in plain words.
if(TARGET bench_collectives)
  add_test(NAME "bench.flags: bench_collectives refuses --iters 0 and --max-bytes abc"
           COMMAND sh -c "! $<TARGET_FILE:bench_collectives> --iters 0 && ! $<TARGET_FILE:bench_collectives> --max-bytes abc")
  set_tests_properties("bench.flags: bench_collectives refuses --iters 0 and --max-bytes abc"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "--iters: 0 is out of range: give a whole number in \\[1, 100000\\].*--max-bytes: 'abc' is not a whole number")
endif()

# bench_collectives checks that its largest message fits before allocating anything.
if(TARGET bench_collectives)
  add_test(NAME "bench.flags: bench_collectives refuses a message larger than memory, at once"
           COMMAND $<TARGET_FILE:bench_collectives> --device cpu --mode ddp --gpus 4
                   --min-bytes 17179869184 --max-bytes 17179869184)
  set_tests_properties("bench.flags: bench_collectives refuses a message larger than memory, at once"
    PROPERTIES TIMEOUT 10
    PASS_REGULAR_EXPRESSION "--max-bytes 17179869184 \\(4 devices or ranks x 2 buffers\\).*the host.*give a smaller --max-bytes")
endif()

# bench_kernels checks its flags before any work (a NaN --min-time timed forever), and neither it
# nor bench_composed replaces a file that is not a report of this project's (both did).
if(TARGET bench_kernels AND TARGET bench_composed)
  add_test(NAME "bench.flags: bench_kernels refuses a NaN --min-time and --sizes 0, before any work"
           COMMAND sh -c "! $<TARGET_FILE:bench_kernels> --device cpu --min-time nan && ! $<TARGET_FILE:bench_kernels> --device cpu --sizes 0")
  set_tests_properties("bench.flags: bench_kernels refuses a NaN --min-time and --sizes 0, before any work"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "--min-time: nan is not allowed: give a number > 0 and <= 3600.*--sizes: 0 is out of range: give a whole number in \\[1, 131072\\]")
  set(notes "${CMAKE_CURRENT_BINARY_DIR}/bench_flags_notes.txt")
  add_test(NAME "bench.flags: bench_kernels and bench_composed never replace a file that is not theirs"
           COMMAND sh -c "echo notes > ${notes} && ! $<TARGET_FILE:bench_kernels> --device cpu --json ${notes} && ! $<TARGET_FILE:bench_composed> --device cpu --json ${notes} && grep -qx notes ${notes} && rm ${notes} && echo kept")
  set_tests_properties("bench.flags: bench_kernels and bench_composed never replace a file that is not theirs"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "--json: '[^']*bench_flags_notes.txt' exists and is not a report of dp_bench, train_mnist, bench_kernels or bench_composed.*--json: '[^']*' exists and is not a report.*kept")
endif()

# bench_collectives refuses, before any table: DDP messages smaller than their ranks' shards
# (rows of 0 bytes), a --min-bytes above the largest message (empty tables, exit 0), and more
# ranks than the node can start (said after every DP table had run).
if(TARGET bench_collectives)
  add_test(NAME "bench.flags: bench_collectives refuses empty tables and too many ranks first"
           COMMAND sh -c "! $<TARGET_FILE:bench_collectives> --device cpu -n 4 --min-bytes 4 --mode ddp && ! $<TARGET_FILE:bench_collectives> --device cpu --min-bytes 17179869184 && ! $<TARGET_FILE:bench_collectives> --device cpu -n 64 --max-bytes 1048576 --iters 1")
  set_tests_properties("bench.flags: bench_collectives refuses empty tables and too many ranks first"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "--min-bytes 4 with -n 4: a DDP message is 4 shards of whole f32 values: give --min-bytes >= 16.*--min-bytes 17179869184 is more than the largest message.*64 ranks on this node is more than this machine can start"
    FAIL_REGULAR_EXPRESSION "dp broadcast_params")
endif()
