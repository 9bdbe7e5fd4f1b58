dp_add_test(test_dp SOURCES test_dp.cpp LIBS dp_engine)
