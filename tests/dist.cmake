# dist: stores, rendezvous, Gloo collectives (ranks as threads) and the launcher (processes of
# tests/dist_worker.cpp).
add_executable(dist_worker dist_worker.cpp)
target_link_libraries(dist_worker PRIVATE dp_distributed CLI11::CLI11)
dp_add_test(test_dist
  SOURCES test_dist_store.cpp test_dist_rendezvous.cpp test_dist_collectives.cpp
          test_dist_launch.cpp test_dist_agree.cpp
  LIBS dp_distributed dp_cli)
target_compile_definitions(test_dist PRIVATE DP_DIST_WORKER_PATH="$<TARGET_FILE:dist_worker>")
add_dependencies(test_dist dist_worker)

# custom_reducer, end to end: 2 workers train with the all-reduce and with its PowerSGD hook
# (non-zero exit when the ranks' weights differ); the hook's row must say it compressed.
if(TARGET custom_reducer)
  add_test(NAME "dist.sample: custom_reducer --nproc 2 trains DDP with a PowerSGD hook"
           COMMAND custom_reducer --nproc 2 --steps 12 --batch 64 --width 128 --start-step 2)
  set_tests_properties("dist.sample: custom_reducer --nproc 2 trains DDP with a PowerSGD hook"
    PROPERTIES TIMEOUT 120
    PASS_REGULAR_EXPRESSION "powersgd-r4 hands [0-9.]+x fewer bytes"
    FAIL_REGULAR_EXPRESSION "DIFFER|custom_reducer: ")
  # Then under DP (threads of the launcher, the hook over an in-process group): each run's five
  # printed losses are those of the same reducer under DDP, so the losses of the four rows make
  # two pairs (uniq counts 2 and 2).
  add_test(NAME "dist.sample: custom_reducer trains the hook under DP and DDP on one loss curve"
           COMMAND sh -c [=[$0 --nproc 2 --steps 12 --batch 64 --width 128 --start-step 2 | grep -o '\(  *[0-9]*\.[0-9][0-9][0-9][0-9]\)\{5\}' | tr -s ' ' | sort | uniq -c]=]
                   $<TARGET_FILE:custom_reducer>)
  set_tests_properties("dist.sample: custom_reducer trains the hook under DP and DDP on one loss curve"
    PROPERTIES TIMEOUT 120 PASS_REGULAR_EXPRESSION "^ *2 [^\n]*\n *2 [^\n]*\n$")
  # One step: its bytes are both the first and the last (the last read 0, and the summary was
  # left out); a rank no bucket shrinks by says so instead of "hands 1.0x fewer bytes".
  add_test(NAME "dist.sample: custom_reducer --steps 1 reports the step's bytes as the last"
           COMMAND custom_reducer --nproc 2 --steps 1 --start-step 0 --width 16 --batch 8)
  set_tests_properties("dist.sample: custom_reducer --steps 1 reports the step's bytes as the last"
    PROPERTIES TIMEOUT 60
    PASS_REGULAR_EXPRESSION "powersgd-r4 +[0-9.]+ +1296, 1296 .*powersgd-r4 hands 5.0x fewer bytes"
    FAIL_REGULAR_EXPRESSION ", 0 |DIFFER|custom_reducer: ")
  add_test(NAME "dist.sample: custom_reducer says when its rank compresses no bucket"
           COMMAND custom_reducer --nproc 2 --steps 2 --start-step 0 --width 16 --batch 8 --rank 1024)
  set_tests_properties("dist.sample: custom_reducer says when its rank compresses no bucket"
    PROPERTIES TIMEOUT 60
    PASS_REGULAR_EXPRESSION "powersgd-r1024 compressed no bucket: .* rank 1024 shrinks none of them enough; give a smaller --rank"
    FAIL_REGULAR_EXPRESSION "fewer bytes|DIFFER|custom_reducer: ")
  # A batch whose activations do not fit is refused with the figures before any rank starts (it
  # passed a check of the parameters alone, and the OOM killer took a rank, reported as hung).
  add_test(NAME "dist.sample: custom_reducer refuses activations that do not fit, before any rank"
           COMMAND custom_reducer --nproc 2 --steps 2 --batch 1048576 --width 8192)
  set_tests_properties("dist.sample: custom_reducer refuses activations that do not fit, before any rank"
    PROPERTIES TIMEOUT 30 WILL_FAIL FALSE
    PASS_REGULAR_EXPRESSION "--width 8192 and --batch 1048576 on --nproc 2 ranks \\(6 copies of 67731466 parameters and 34437332992 activation values each\\) needs at least 259.6 GiB"
    FAIL_REGULAR_EXPRESSION "rank 0|rank 1")
endif()

# The sample, end to end: it launches 3 workers of itself and checks its ring against the
# library's all-reduce (non-zero exit when they disagree).
if(TARGET communication)
  add_test(NAME "dist.sample: communication --nproc 3"
           COMMAND communication --nproc 3 --elements 100003 --chunk 4096 --reps 1)
  set_tests_properties("dist.sample: communication --nproc 3" PROPERTIES TIMEOUT 120)
  # NCCL on CPU tensors: refused once, before any rank starts (each rank said it, after).
  add_test(NAME "dist.sample: communication refuses --backend nccl on CPU tensors before its ranks"
           COMMAND communication --nproc 2 --backend nccl --device cpu)
  set_tests_properties("dist.sample: communication refuses --backend nccl on CPU tensors before its ranks"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "--backend nccl: (NCCL needs a CUDA device on every rank|this build has no NCCL)"
    FAIL_REGULAR_EXPRESSION "launch_workers|rank 0 has its tensors")
  add_test(NAME "dist.sample: communication refuses --nproc 9 in plain words"
           COMMAND communication --nproc 9)
  set_tests_properties("dist.sample: communication refuses --nproc 9 in plain words" PROPERTIES
    TIMEOUT 30 PASS_REGULAR_EXPRESSION "--nproc: 9 is out of range: give a whole number in \\[2, 4\\]")
endif()
