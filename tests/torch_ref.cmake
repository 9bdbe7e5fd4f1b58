# benchmarks/torch_ref (Python): the bootstrap interval of stats.py on cases with a known answer
# (standard library only, so it runs on any python3), and side_by_side.sh's one-line skip where
# torch is not installed. `ctest -R bench.torch_ref` runs them.
find_program(DP_PYTHON3 python3)
if(DP_PYTHON3)
  set(torch_ref_dir ${PROJECT_SOURCE_DIR}/benchmarks/torch_ref)
  foreach(case
      "Median.test_odd_even_and_empty|median of odd, even and empty lists"
      "BootstrapRatioCi.test_contains_the_known_ratio_and_is_narrow_for_large_k|bootstrap CI holds the known median ratio and is narrow at K=200"
      "BootstrapRatioCi.test_narrows_as_k_grows|bootstrap CI narrows as K grows"
      "BootstrapRatioCi.test_covers_the_known_ratio_about_95_percent_of_the_time|bootstrap CI covers the known ratio in at least 85 of 100 draws"
      "BootstrapRatioCi.test_equal_inputs_are_within_noise|equal inputs give an interval holding 1, within noise"
      "BootstrapRatioCi.test_same_distribution_k5_is_within_noise|two K=5 draws of one distribution are within noise"
      "BootstrapRatioCi.test_clearly_slower_at_k5|a 2x slower K=5 sample is ours slower"
      "BootstrapRatioCi.test_fixed_seed_is_reproducible|the fixed seed gives the same interval twice"
      "BootstrapRatioCi.test_refuses_bad_input|bootstrap refuses empty, non-positive and too few resamples")
    string(REPLACE "|" ";" parts "${case}")
    list(GET parts 0 method)
    list(GET parts 1 title)
    add_test(NAME "bench.torch_ref: ${title}"
             COMMAND ${DP_PYTHON3} -B -m unittest -v test_stats.${method}
             WORKING_DIRECTORY ${torch_ref_dir})
    set_tests_properties("bench.torch_ref: ${title}" PROPERTIES TIMEOUT 120)
  endforeach()
endif()

add_test(NAME "bench.torch_ref: side_by_side.sh without torch prints one line and exits 0"
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/torch_ref_no_torch.sh
                 ${PROJECT_SOURCE_DIR}/benchmarks/torch_ref/side_by_side.sh ${CMAKE_BINARY_DIR})
set_tests_properties("bench.torch_ref: side_by_side.sh without torch prints one line and exits 0"
                     PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 60)

# variants.py --model gpt: torch's GPT does dp_bench's work (same-work check); skipped (77)
# where python3 (or $PYTHON) has no torch.
if(TARGET dp_bench)
  add_test(NAME "bench.torch_ref: gpt-tiny in torch does the same work as dp_bench --model gpt"
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/torch_ref_gpt.sh
                   ${PROJECT_SOURCE_DIR}/benchmarks/torch_ref/variants.py ${CMAKE_BINARY_DIR})
  set_tests_properties("bench.torch_ref: gpt-tiny in torch does the same work as dp_bench --model gpt"
                       PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 120)
endif()

# benchmarks/ncu_summary.py on the H200 profile committed beside it: the known totals (one step
# of GPT-2 124M at batch 8), and a file that is no ncu CSV refused with its name.
if(DP_PYTHON3)
  set(ncu_csv ${PROJECT_SOURCE_DIR}/benchmarks/results/2026-11-29_nvidia-h200/ncu_gpt124m_b8.csv.gz)
  add_test(NAME "bench.ncu_summary: the H200 GPT-2 profile sums to its kernels by kind"
           COMMAND ${DP_PYTHON3} -B ${PROJECT_SOURCE_DIR}/benchmarks/ncu_summary.py ${ncu_csv})
  set_tests_properties("bench.ncu_summary: the H200 GPT-2 profile sums to its kernels by kind"
                       PROPERTIES TIMEOUT 60 PASS_REGULAR_EXPRESSION
                       "22.978 ms of kernel time, 535 launches.*GEMM +8.589 +37.4%.*dp/backward +11.149")
  add_test(NAME "bench.ncu_summary: a file that is no ncu CSV is refused by name"
           COMMAND ${DP_PYTHON3} -B ${PROJECT_SOURCE_DIR}/benchmarks/ncu_summary.py
                   ${PROJECT_SOURCE_DIR}/benchmarks/results/README.md)
  set_tests_properties("bench.ncu_summary: a file that is no ncu CSV is refused by name"
                       PROPERTIES TIMEOUT 60 PASS_REGULAR_EXPRESSION
                       "ncu_summary: .*README.md: no CSV rows")
endif()
