# pkg.consumer: install this build into an empty prefix under the build folder, build
# tests/consumer/ against it with find_package(dptrain), run it, and check that the program
# links no CUDA library and that the pkg-config file compiles and links a program too.
#   cmake -DBUILD_DIR=<build> -DSOURCE_DIR=<source> -DCXX=<c++> [-DLAUNCHER=ccache]
#         [-DSANITIZE=-fsanitize=...] -P run.cmake
# SANITIZE: a sanitizer build's flag, which its installed (instrumented) libraries need at link.
set(work ${BUILD_DIR}/pkg_consumer)
set(prefix ${work}/prefix)
file(REMOVE_RECURSE ${work})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    string(JOIN " " cmd ${ARGN})
    message(FATAL_ERROR "pkg.consumer: `${cmd}` failed (${rc}):\n${out}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
foreach(f include/dptrain/nn/nn.hpp include/dptrain/dp/data_parallel.hpp
          include/dptrain/kernels/ops.hpp lib/cmake/dptrain/dptrainConfig.cmake
          lib/cmake/dptrain/dptrainConfigVersion.cmake lib/pkgconfig/dptrain.pc)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "pkg.consumer: the install has no ${f}")
  endif()
endforeach()
foreach(f include/dptrain/dp/cli/cli.hpp include/dptrain/benchmarks/compare.hpp)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "pkg.consumer: the install has no ${f} (dptrain::cli, dptrain::compare)")
  endif()
endforeach()

set(args -S ${SOURCE_DIR}/tests/consumer -B ${work}/build -DCMAKE_PREFIX_PATH=${prefix}
         -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX})
if(LAUNCHER)
  list(APPEND args -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()
if(SANITIZE)
  list(APPEND args -DCMAKE_CXX_FLAGS=${SANITIZE} -DCMAKE_EXE_LINKER_FLAGS=${SANITIZE})
endif()
run(${CMAKE_COMMAND} ${args})
run(${CMAKE_COMMAND} --build ${work}/build -j2)
run(${work}/build/consumer ${work}/state.safetensors)
message(STATUS "${out}")
if(NOT out MATCHES "backend: cpu;")
  message(FATAL_ERROR "pkg.consumer: the CPU-only consumer does not report the CPU backend")
endif()
execute_process(COMMAND ${work}/build/readme_example WORKING_DIRECTORY ${work} RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0 OR NOT EXISTS ${work}/my_model.safetensors)
  message(FATAL_ERROR "pkg.consumer: the README's program failed (${rc}):\n${out}")
endif()
# The README prints that program: it must be the one built here, character for character.
file(READ ${SOURCE_DIR}/tests/consumer/readme.cpp program)
file(READ ${SOURCE_DIR}/README.md readme)
string(FIND "${readme}" "${program}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "pkg.consumer: README.md no longer shows tests/consumer/readme.cpp as is")
endif()

# The comparison from the install: DP and DDP (2 processes) on the sample's own model, one report.
run(${work}/build/compare_my_model --device cpu --gpus 2 --mode both --steps 3 --warmup 1
    --batch 24 --repeat 1)
if(NOT out MATCHES "dp_bench: model residual_mlp" OR NOT out MATCHES "verdict: residual_mlp")
  message(FATAL_ERROR "pkg.consumer: the installed comparison gave no report:\n${out}")
endif()

# The helpers from the install: three steps logged one JSON line each; a bad flag refused.
run(${work}/build/cli_example --steps 3 --log ${work}/steps.jsonl)
file(STRINGS ${work}/steps.jsonl logged)
list(LENGTH logged n_logged)
if(NOT n_logged EQUAL 3 OR NOT logged MATCHES "\"step\":3")
  message(FATAL_ERROR "pkg.consumer: cli_example logged ${n_logged} steps:\n${logged}")
endif()
execute_process(COMMAND ${work}/build/cli_example --steps 0 RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0 OR NOT out MATCHES "--steps")
  message(FATAL_ERROR "pkg.consumer: cli_example took --steps 0 (${rc}):\n${out}")
endif()

# A CPU-only consumer carries no CUDA code: no CUDA runtime, cuBLAS, cuDNN or NCCL symbol.
find_program(NM nm)
if(NM)
  run(${NM} ${work}/build/consumer)
  string(REGEX MATCH "[ \t](cuda[A-Z][A-Za-z]*|cudnn[A-Z][A-Za-z]*|cublas[A-Za-z]*|nccl[A-Z][A-Za-z]*)" cuda "${out}")
  if(cuda)
    message(FATAL_ERROR "pkg.consumer: the CPU-only consumer links CUDA code (${cuda})")
  endif()
endif()

# COMPONENTS cuda: when the install has the CUDA backend, the same program linked against it
# (cudart, cuBLAS(Lt), cuDNN, NCCL) runs here too, on CPU devices when no GPU is present.
file(STRINGS ${prefix}/lib/cmake/dptrain/dptrainConfig.cmake have_cuda
     REGEX "set\\(dptrain_HAVE_CUDA ON\\)")
if(have_cuda)
  set(cuda_args ${args})
  list(TRANSFORM cuda_args REPLACE "^${work}/build$" "${work}/build_cuda")
  run(${CMAKE_COMMAND} ${cuda_args} -DCONSUMER_CUDA=ON)
  run(${CMAKE_COMMAND} --build ${work}/build_cuda -j2 --target consumer)
  run(${work}/build_cuda/consumer ${work}/state_cuda.safetensors)
  message(STATUS "COMPONENTS cuda: ${out}")
  if(NOT out MATCHES "backend: cuda;")
    message(FATAL_ERROR "pkg.consumer: COMPONENTS cuda did not link the CUDA backend:\n${out}")
  endif()
else()
  message(STATUS "pkg.consumer: the install has no CUDA backend: COMPONENTS cuda not tried")
endif()

# pkg-config: the same install, flags from dptrain.pc, a small program on the op set.
find_program(PKG_CONFIG pkg-config)
if(PKG_CONFIG)
  set(ENV{PKG_CONFIG_PATH} ${prefix}/lib/pkgconfig)
  run(${PKG_CONFIG} --cflags --libs dptrain)
  separate_arguments(flags UNIX_COMMAND "${out}")
  run(${CXX} -std=c++17 -O1 ${SANITIZE} ${SOURCE_DIR}/tests/consumer/pkg_config_check.cpp ${flags}
      -o ${work}/pkg_config_check)
  run(${work}/pkg_config_check)
  message(STATUS "pkg-config: ${out}")
endif()
