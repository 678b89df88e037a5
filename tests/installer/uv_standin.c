/* A stand-in for uv.exe in tests/installer/test_inno_wine.py. The real uv.exe starts under
 * wine 8 only with the test's bcryptprimitives.dll (wine 8 lacks it), and a virtualenv and
 * wheels need a real Windows CPython to run, which cannot be fetched here. So the setup is
 * compiled with this program in uv's place, and it does what the setup's flow needs from uv:
 *   uv python install ...       runs the real uv.exe ($STRATA_TEST_REAL_UV) with the same
 *                               arguments: a real download of the test's Python archive from
 *                               127.0.0.1, its hash checked, unpacked into UV_PYTHON_INSTALL_DIR;
 *   uv venv ... DIR             finds that Python and makes DIR\Scripts\python.exe, pythonw.exe;
 *   uv pip install ... NAMES    fetches each NAME's simple-index page from --index-url, else
 *                               UV_DEFAULT_INDEX (the test's server on 127.0.0.1), and each
 *                               .whl path must exist (Strata's also gets Scripts\strata.exe).
 * It prints lines in uv's style. Every call is appended to C:\strata-test\uv-calls.txt with
 * the settings it ran under. An error (a missing setting, a failed download) prints
 * "error: ..." and exits 2, as uv does. Started as python.exe or strata.exe (the copies above)
 * it prints a version and exits 0.
 *
 * Built by the test with x86_64-w64-mingw32-gcc (Debian: gcc-mingw-w64-x86-64-win32). */
#include <windows.h>
#include <wininet.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>

static FILE *calls;

static int fail(const char *message, const char *detail) {
    fprintf(stderr, "error: %s%s\n", message, detail ? detail : "");
    if (calls) fprintf(calls, "  failed: %s%s\n", message, detail ? detail : "");
    return 2;
}

static const char *setting(const char *name) {
    const char *value = getenv(name);
    if (calls) fprintf(calls, "  %s=%s\n", name, value ? value : "");
    return value && *value ? value : NULL;
}

static long fetch(const char *url, const char *path) {
    /* Bytes written, or -1 when the download failed or the server did not answer 200. */
    HINTERNET net = InternetOpenA("uv-standin", INTERNET_OPEN_TYPE_DIRECT, NULL, NULL, 0), req;
    DWORD status = 0, length = sizeof status, got;
    char buffer[65536];
    long size = 0;
    FILE *out;
    req = net ? InternetOpenUrlA(net, url, NULL, 0, INTERNET_FLAG_RELOAD | INTERNET_FLAG_NO_CACHE_WRITE, 0) : NULL;
    if (!req || !HttpQueryInfoA(req, HTTP_QUERY_STATUS_CODE | HTTP_QUERY_FLAG_NUMBER, &status, &length, NULL)
        || status != 200 || !(out = fopen(path, "wb"))) {
        if (req) InternetCloseHandle(req);
        if (net) InternetCloseHandle(net);
        return -1;
    }
    while (InternetReadFile(req, buffer, sizeof buffer, &got) && got > 0) {
        fwrite(buffer, 1, got, out);
        size += (long)got;
    }
    fclose(out);
    InternetCloseHandle(req);
    InternetCloseHandle(net);
    return size;
}

static int copy_self(const char *dir, const char *name) {
    char self[MAX_PATH], target[MAX_PATH];
    GetModuleFileNameA(NULL, self, MAX_PATH);
    snprintf(target, MAX_PATH, "%s\\%s", dir, name);
    return CopyFileA(self, target, FALSE) ? 0 : fail("could not write ", target);
}

static int python_install(void) {
    /* The real uv.exe does this step: it runs under wine with the test's bcryptprimitives.dll. */
    const char *real = setting("STRATA_TEST_REAL_UV"), *line = GetCommandLineA();
    char command[8192];
    STARTUPINFOA startup = {sizeof startup};
    PROCESS_INFORMATION process;
    DWORD code = 2;
    if (!real) return fail("stand-in: STRATA_TEST_REAL_UV is not set", NULL);
    setting("UV_PYTHON_INSTALL_DIR");
    setting("UV_PYTHON_INSTALL_MIRROR");
    setting("UV_PYTHON_DOWNLOADS_JSON_URL");
    if (*line == '"') line = strchr(line + 1, '"') + 1;  /* past this program's own name */
    else line += strcspn(line, " ");
    snprintf(command, sizeof command, "\"%s\"%s", real, line);
    fflush(stdout);
    if (!CreateProcessA(real, command, NULL, NULL, TRUE, 0, NULL, NULL, &startup, &process))
        return fail("stand-in: could not start ", real);
    WaitForSingleObject(process.hProcess, INFINITE);
    GetExitCodeProcess(process.hProcess, &code);
    if (calls) fprintf(calls, "  real uv exited %lu\n", code);
    return (int)code;
}

static int venv(int argc, char **argv) {
    const char *target = argv[argc - 1], *pythons = setting("UV_PYTHON_INSTALL_DIR");
    char scripts[MAX_PATH], pattern[MAX_PATH];
    WIN32_FIND_DATAA found;
    HANDLE search;
    if (!pythons) return fail("stand-in: UV_PYTHON_INSTALL_DIR is not set", NULL);
    /* The Python that the real uv installed in the step before, as uv would find it. */
    snprintf(pattern, MAX_PATH, "%s\\cpython-3.12.*", pythons);
    if ((search = FindFirstFileA(pattern, &found)) == INVALID_HANDLE_VALUE)
        return fail("No interpreter found for Python 3.12 in managed installations", NULL);
    FindClose(search);
    printf("Using CPython 3.12.12\nCreating virtual environment at: %s\n", target);
    CreateDirectoryA(target, NULL);
    snprintf(scripts, MAX_PATH, "%s\\Scripts", target);
    CreateDirectoryA(scripts, NULL);
    if (copy_self(scripts, "python.exe") || copy_self(scripts, "pythonw.exe")) return 2;
    return 0;
}

static int pip_install(int argc, char **argv) {
    const char *index = NULL, *python = NULL;
    char scripts[MAX_PATH], url[2048], page[MAX_PATH];
    int i, installed = 0;
    for (i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--index-url") && i + 1 < argc) index = argv[++i];
        else if (!strcmp(argv[i], "--python") && i + 1 < argc) python = argv[++i];
        else if (!strcmp(argv[i], "--constraints") && i + 1 < argc) {
            if (GetFileAttributesA(argv[++i]) == INVALID_FILE_ATTRIBUTES)
                return fail("File not found: ", argv[i]);
        }
    }
    if (!index) index = setting("UV_DEFAULT_INDEX");
    if (!index) return fail("stand-in: neither --index-url nor UV_DEFAULT_INDEX", NULL);
    if (!python || GetFileAttributesA(python) == INVALID_FILE_ATTRIBUTES)
        return fail("No virtual environment found at --python ", python);
    snprintf(scripts, MAX_PATH, "%s", python);
    *strrchr(scripts, '\\') = 0;
    for (i = 3; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--index-url") || !strcmp(arg, "--python") ||
            !strcmp(arg, "--constraints") || !strcmp(arg, "--reinstall-package")) { i++; continue; }
        if (arg[0] == '-') continue;
        if (strstr(arg, ".whl")) {
            if (GetFileAttributesA(arg) == INVALID_FILE_ATTRIBUTES)
                return fail("Distribution not found at: ", arg);
            if (copy_self(scripts, "strata.exe")) return 2;
        } else {
            char name[256];
            long size;
            snprintf(name, sizeof name, "%.*s", (int)strcspn(arg, "=<>!~"), arg);
            snprintf(url, sizeof url, "%s/%s/", index, name);
            snprintf(page, MAX_PATH, "%s\\%s.index.html", scripts, name);
            printf("Downloading %s\n", name);
            fflush(stdout);
            if ((size = fetch(url, page)) < 0) {
                /* uv's errors go on with their causes: the reason is the "error:" line. */
                fail("Failed to fetch: ", url);
                fprintf(stderr, "  Caused by: HTTP status client error (404 Not Found) for url (%s)\n", url);
                return 2;
            }
            printf("Downloaded %s (%ld bytes)\n", name, size);
            fflush(stdout);
            Sleep(300);
        }
        installed++;
    }
    printf("Installed %d packages in 12ms\n", installed);
    return 0;
}

int main(int argc, char **argv) {
    char self[MAX_PATH];
    const char *base;
    GetModuleFileNameA(NULL, self, MAX_PATH);
    base = strrchr(self, '\\') ? strrchr(self, '\\') + 1 : self;
    if (_stricmp(base, "uv.exe")) {  /* a copy: python.exe, pythonw.exe or strata.exe */
        printf(_stricmp(base, "strata.exe") ? "Python 3.12.12\n" : "strata 0.1.0\n");
        return 0;
    }
    calls = fopen("C:\\strata-test\\uv-calls.txt", "a");
    if (calls) {
        int i;
        fprintf(calls, "uv");
        for (i = 1; i < argc; i++) fprintf(calls, " %s", argv[i]);
        fprintf(calls, "\n");
        setting("UV_CACHE_DIR");
    }
    if (argc > 2 && !strcmp(argv[1], "python") && !strcmp(argv[2], "install")) return python_install();
    if (argc > 2 && !strcmp(argv[1], "venv")) return venv(argc, argv);
    if (argc > 3 && !strcmp(argv[1], "pip") && !strcmp(argv[2], "install")) return pip_install(argc, argv);
    return fail("stand-in: unknown command ", argc > 1 ? argv[1] : "");
}
