# Install rules and the packages a consumer finds SCAPE with (included by the top-level
# CMakeLists.txt after every target exists):
#
#   <prefix>/lib/libnccl-net-scape.so.X.Y.Z      the library (SONAME libnccl-net-scape.so.X)
#   <prefix>/lib/libnccl-net-scape.so.X          -> .so.X.Y.Z
#   <prefix>/lib/libnccl-net-scape.so            -> .so.X  (what NCCL_NET_PLUGIN=scape dlopens)
#   <prefix>/lib/libnccl-net.so                  -> .so.X  (what NCCL opens when it is unset)
#   <prefix>/include/scape/scape.h, scape_version.h
#   <prefix>/lib/cmake/scape/scapeConfig.cmake (+ Version, Targets): find_package(scape) -> scape::scape
#   <prefix>/lib/pkgconfig/scape.pc              pkg-config --cflags --libs scape
#   <prefix>/bin/scape-perf
#
# tests/packaging/ installs into a temporary prefix and builds a consumer both ways.
include(CMakePackageConfigHelpers)

set(SCAPE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/scape)

install(TARGETS nccl-net-scape EXPORT scapeTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})  # include dir: INSTALL_INTERFACE in plugin/
# The libnccl-net.so symlink made beside the library at build time (plugin/CMakeLists.txt);
# file(INSTALL) copies a symlink as a symlink.
install(FILES ${PROJECT_BINARY_DIR}/lib/libnccl-net.so DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES ${PROJECT_SOURCE_DIR}/include/scape/scape.h
              ${PROJECT_BINARY_DIR}/include/scape/scape_version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/scape)

install(EXPORT scapeTargets NAMESPACE scape:: FILE scapeTargets.cmake
        DESTINATION ${SCAPE_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/scapeConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/scapeConfig.cmake
  INSTALL_DESTINATION ${SCAPE_CMAKE_DIR}
  PATH_VARS CMAKE_INSTALL_INCLUDEDIR)
# 0.x: a new minor version may change the ABI, so only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/scapeConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/scapeConfig.cmake
              ${PROJECT_BINARY_DIR}/cmake/scapeConfigVersion.cmake
        DESTINATION ${SCAPE_CMAKE_DIR})

# pkg-config: paths relative to the .pc file, so the installed tree can be moved (and
# `cmake --install --prefix DIR` works without reconfiguring).
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(SCAPE_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(SCAPE_PC_LIBDIR "${CMAKE_INSTALL_FULL_LIBDIR}")
  set(SCAPE_PC_INCLUDEDIR "${CMAKE_INSTALL_FULL_INCLUDEDIR}")
else()
  file(RELATIVE_PATH _scape_pc_up "/root/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/root")
  string(REGEX REPLACE "/$" "" _scape_pc_up "${_scape_pc_up}")
  set(SCAPE_PC_PREFIX "\${pcfiledir}/${_scape_pc_up}")
  set(SCAPE_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
  set(SCAPE_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/scape.pc.in ${PROJECT_BINARY_DIR}/scape.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/scape.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

if(TARGET scape-perf)
  # scape-perf finds the library it was installed with.
  set_target_properties(scape-perf PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
  install(TARGETS scape-perf RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

# The Python wheel (pyproject.toml; scikit-build-core installs this component only, into the
# wheel's root): the library as scape/libnccl-net-scape.so beside the package, where
# python/scape/_lib.py finds it. One file (a wheel holds no symbolic links); loaded by path,
# its SONAME does not matter. Not part of a plain `cmake --install`.
install(FILES $<TARGET_FILE:nccl-net-scape> DESTINATION scape RENAME libnccl-net-scape.so
        COMPONENT wheel EXCLUDE_FROM_ALL)
