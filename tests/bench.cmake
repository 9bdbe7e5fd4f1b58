if(TARGET dp_bench)
  dp_add_test(test_bench SOURCES test_bench.cpp LIBS dp_bench_report)
  target_compile_definitions(test_bench PRIVATE DP_BENCH_PATH="$<TARGET_FILE:dp_bench>")
  add_dependencies(test_bench dp_bench)
endif()
# bench_collectives checks its flags before any work, in plain words.
if(TARGET bench_collectives)
  add_test(NAME "bench.flags: bench_collectives refuses --iters 0 and --max-bytes abc"
           COMMAND sh -c "! $<TARGET_FILE:bench_collectives> --iters 0 && ! $<TARGET_FILE:bench_collectives> --max-bytes abc")
  set_tests_properties("bench.flags: bench_collectives refuses --iters 0 and --max-bytes abc"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "--iters: 0 is out of range: give a whole number in \\[1, 100000\\].*--max-bytes: 'abc' is not a whole number")
endif()
