<#
.SYNOPSIS
    Install Strata for the current user without building an installer (or uninstall it).

.DESCRIPTION
    Creates a virtualenv in -Prefix (default %LOCALAPPDATA%\Programs\Strata\venv) with the
    newest Python 3.11+ that `py -0p` lists, installs PyTorch (the CUDA build from PyTorch's
    index where an NVIDIA driver answers `nvidia-smi`, since PyPI's Windows PyTorch has no CUDA;
    else PyPI's CPU build) and then Strata from a checkout or a wheel, adds a Start-menu
    shortcut and, with -Autostart, the same login entry the tray's "Start at login" switch
    writes (HKCU\...\Run, value "Strata").
    Models, snapshots and the config file live outside -Prefix and survive an uninstall;
    -PurgeModels deletes the model cache too. Runs under Windows PowerShell 5.1 (what Inno Setup
    starts) and PowerShell 7. Exit code 0 on success, 1 with the reason on stderr and, with
    -ErrorFile, in that file (strata.iss shows it).

    NOT RUN ON WINDOWS: written on Linux; it is parsed and its Python-finding patterns are
    tested there (tests/installer/test_install_ps1.py). See docs/getting-started.md.

.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installer\windows\install.ps1 -Autostart
.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installer\windows\install.ps1 -Uninstall -PurgeModels
#>
[CmdletBinding()]
param(
    [string]$Prefix = (Join-Path $env:LOCALAPPDATA "Programs\Strata"),
    [string]$Python = "",            # an interpreter path; default: the newest 3.11+ from `py -0p`
    [string]$Source = $env:STRATA_SOURCE,  # a checkout or a .whl; default: this checkout
    [string]$TorchVersion = "2.13.0",  # pinned: the version Strata is tested with
    [string]$TorchIndexUrl = "https://download.pytorch.org/whl/cu128",
    [switch]$CpuOnly,                # PyTorch from PyPI (CPU build) even with an NVIDIA driver
    [string]$ErrorFile = "",         # where the reason of a failure is written (for strata.iss)
    [switch]$Autostart,
    [switch]$NoShortcut,             # the Inno Setup installer makes its own shortcut
    [switch]$Uninstall,
    [switch]$StopOnly,               # only stop a running Strata of -Prefix (strata.iss, upgrades)
    [switch]$PurgeModels
)

$ErrorActionPreference = "Stop"

# `py -0p` lists interpreters one a line: " -V:3.12 *   C:\...\python.exe" (launcher 3.11+) or
# " -3.9-64   C:\...\python.exe *" (older launchers). A line is a candidate when it matches
# $PyListPattern, its tag matches $PyTagAllowed (64-bit CPython: not -32, -arm64 or the 3.13t
# free-threaded build, which PyTorch's CUDA wheels lack) and its minor version is at least
# $PyMinMinor; the newest is tried first. tests/installer/test_install_ps1.py checks these
# patterns on recorded outputs.
$PyListPattern = '^\s*-(?:V:)?(?:PythonCore/)?(?<major>3)\.(?<minor>\d+)(?<tag>\S*)\s+(?:\*\s+)?(?<path>[A-Za-z]:\\.*?\.exe)(?:\s+\*)?\s*$'
$PyTagAllowed = '^(-64)?$'
$PyMinMinor = 11
$Venv = Join-Path $Prefix "venv"
$VenvPython = Join-Path $Venv "Scripts\python.exe"
$VenvPythonw = Join-Path $Venv "Scripts\pythonw.exe"
$IconPath = Join-Path $Prefix "strata.ico"
$Shortcut = Join-Path ([Environment]::GetFolderPath("Programs")) "Strata.lnk"

function Fail([string]$Message) {
    [Console]::Error.WriteLine("install.ps1: error: $Message")
    if ($ErrorFile) { [IO.File]::WriteAllText($ErrorFile, $Message) }  # UTF-8 without a BOM
    exit 1
}

function Say([string]$Message) { Write-Host "install.ps1: $Message" }

function Invoke-Native([string]$Exe, [string[]]$Arguments) {
    # Windows PowerShell 5.1 turns each stderr line of a native command into an error record,
    # which "Stop" makes a terminating error (pip's warnings, py's "not found"): run natives
    # with "Continue" (this function's scope only) and judge them by their exit code alone.
    $ErrorActionPreference = "Continue"
    if (-not (Get-Command $Exe -ErrorAction SilentlyContinue)) {
        $global:LASTEXITCODE = 9009  # what cmd.exe reports for a missing program
        return "could not run ${Exe}: not found"
    }
    & $Exe @Arguments 2>&1 | ForEach-Object { "$_" }
}

function Stop-RunningStrata {
    # The tray and its engines hold the venv's files open (an upgrade or uninstall would fail).
    # A venv's python.exe is a launcher that starts the base interpreter, so its descendants
    # are stopped too.
    $all = @(Get-CimInstance Win32_Process)
    $ids = @($all | Where-Object {
        $_.ExecutablePath -and $_.ExecutablePath.StartsWith($Venv, [StringComparison]::OrdinalIgnoreCase)
    } | ForEach-Object { $_.ProcessId })
    do {
        $more = @($all | Where-Object {
            ($ids -contains $_.ParentProcessId) -and ($ids -notcontains $_.ProcessId)
        } | ForEach-Object { $_.ProcessId })
        $ids += $more
    } while ($more.Count -gt 0)
    if ($ids.Count -eq 0) { return }
    Say "stopping the running Strata (processes $($ids -join ', '))"
    foreach ($id in $ids) { Stop-Process -Id $id -Force -ErrorAction SilentlyContinue }
    Start-Sleep -Milliseconds 500
}

function Invoke-Checked([string]$What, [string]$Exe, [string[]]$Arguments) {
    $lines = @(Invoke-Native $Exe $Arguments | ForEach-Object { Write-Host $_; $_ })
    if ($LASTEXITCODE -ne 0) {
        $last = ($lines | Where-Object { $_.Trim() } | Select-Object -Last 1)
        Fail "$What failed (exit code $LASTEXITCODE): $last"
    }
}

function Get-PythonCandidates([string[]]$Lines) {
    # The rules are described next to $PyListPattern above.
    $found = foreach ($line in $Lines) {
        $m = [regex]::Match($line, $PyListPattern)
        if ($m.Success -and [int]$m.Groups["minor"].Value -ge $PyMinMinor -and
            $m.Groups["tag"].Value -match $PyTagAllowed) {
            [pscustomobject]@{ Minor = [int]$m.Groups["minor"].Value; Path = $m.Groups["path"].Value }
        }
    }
    return @($found | Sort-Object -Property Minor -Descending | ForEach-Object { $_.Path })
}

function Find-Python {
    $check = "import sys, struct; sys.exit(sys.version_info < (3, 11) or struct.calcsize('P') != 8)"
    if ($Python) {
        Invoke-Native $Python @("-c", $check) | Out-Null
        if ($LASTEXITCODE -ne 0) { Fail "$Python is not a 64-bit Python 3.11 or newer; pass another with -Python" }
        return $Python
    }
    $listing = @(Invoke-Native "py" @("-0p"))
    foreach ($candidate in (Get-PythonCandidates $listing)) {
        Invoke-Native $candidate @("-c", $check) | Out-Null
        if ($LASTEXITCODE -eq 0) { return $candidate }
    }
    Fail ("no 64-bit Python 3.11 or newer found by ``py -0p`` (it listed: " +
          (($listing | Where-Object { $_.Trim() }) -join "; ") +
          "); install one from python.org or pass -Python")
}

function Test-NvidiaDriver {
    # nvidia-smi ships with the driver (System32) and fails when no driver is loaded.
    if (-not (Get-Command "nvidia-smi" -ErrorAction SilentlyContinue)) { return $false }
    Invoke-Native "nvidia-smi" @("-L") | Out-Null
    return $LASTEXITCODE -eq 0
}

function Find-Source {
    $src = $Source
    if (-not $src) { $src = (Resolve-Path (Join-Path $PSScriptRoot "..\..")).Path }
    if ($src.EndsWith(".whl")) {
        if (-not (Test-Path $src -PathType Leaf)) { Fail "the wheel $src does not exist" }
    } elseif (-not (Test-Path (Join-Path $src "pyproject.toml"))) {
        Fail "$src is not a Strata checkout (no pyproject.toml); pass -Source with a checkout or a .whl"
    }
    return $src
}

function Set-Autostart([bool]$Enabled) {
    # strata.app.autostart writes the value the tray reads, so the two always agree.
    $code = "import sys; from strata.app.autostart import set_autostart; " +
            "set_autostart(sys.argv[1] == 'on', [sys.argv[2], '-m', 'strata.app.main'])"
    $state = if ($Enabled) { "on" } else { "off" }
    Invoke-Checked "changing the login entry" $VenvPython @("-c", $code, $state, $VenvPythonw)
}

function Install-Strata {
    $interpreter = Find-Python
    $src = Find-Source
    if (Test-Path $VenvPython) { Stop-RunningStrata }  # an upgrade
    New-Item -ItemType Directory -Force -Path $Prefix | Out-Null
    Say "creating a virtualenv in $Venv with $interpreter"
    Invoke-Checked "creating the virtualenv" $interpreter @("-m", "venv", $Venv)
    Invoke-Checked "updating pip" $VenvPython @("-m", "pip", "install", "--upgrade", "pip")
    if (-not $CpuOnly -and (Test-NvidiaDriver)) {
        Say "NVIDIA driver found: installing PyTorch $TorchVersion with CUDA from $TorchIndexUrl (a few GB)"
        Invoke-Checked "installing PyTorch with CUDA" $VenvPython @("-m", "pip", "install", "torch==$TorchVersion", "--index-url", $TorchIndexUrl)
    } else {
        Say "no NVIDIA driver (or -CpuOnly): installing PyPI's CPU build of PyTorch $TorchVersion"
        Invoke-Checked "installing PyTorch" $VenvPython @("-m", "pip", "install", "torch==$TorchVersion")
    }
    Say "installing Strata from $src"
    Invoke-Checked "installing Strata" $VenvPython @("-m", "pip", "install", $src)
    # The same version again (a reinstall or a rebuilt wheel) counts as installed for pip.
    Invoke-Checked "reinstalling Strata" $VenvPython @("-m", "pip", "install", "--no-deps", "--force-reinstall", $src)

    # Windows shortcuts need an .ico; render it from the packaged SVG with Qt, which Strata ships.
    $iconCode = "import sys; from importlib.resources import files; " +
        "from PySide6.QtGui import QGuiApplication, QIcon; app = QGuiApplication(['x']); " +
        "icon = QIcon(str(files('strata.resources') / 'icons' / 'strata.svg')); " +
        "sys.exit(0 if icon.pixmap(256, 256).save(sys.argv[1], 'ICO') else 1)"
    $env:QT_QPA_PLATFORM = "offscreen"
    Invoke-Native $VenvPython @("-c", $iconCode, $IconPath) | Out-Null
    if ($LASTEXITCODE -ne 0) { Say "could not render strata.ico; the shortcut gets Python's icon" }

    if (-not $NoShortcut) {
        $shell = New-Object -ComObject WScript.Shell
        $link = $shell.CreateShortcut($Shortcut)
        $link.TargetPath = $VenvPythonw   # pythonw: the tray opens no console window
        $link.Arguments = "-m strata.app.main"
        $link.WorkingDirectory = $Prefix
        if (Test-Path $IconPath) { $link.IconLocation = $IconPath }
        $link.Description = "Strata: local LLM server that shares the GPU"
        $link.Save()
        Say "added the Start-menu entry $Shortcut"
    }
    if ($Autostart) { Set-Autostart $true; Say "Strata's tray starts at login" }
    $version = (Invoke-Native (Join-Path $Venv "Scripts\strata.exe") @("--version")) -join " "
    if ($LASTEXITCODE -ne 0) { Fail "the installed strata.exe does not run: $version" }
    Say "installed $version into $Prefix; run $Venv\Scripts\strata.exe or start Strata from the Start menu"
}

function Uninstall-Strata {
    if (-not (Test-Path $VenvPython)) { Fail "no Strata installation in $Prefix; check -Prefix" }
    Stop-RunningStrata
    $models = ""
    if ($PurgeModels) {
        $models = ((Invoke-Native $VenvPython @("-c", "from strata.paths import model_cache_dir; print(model_cache_dir())")) -join "").Trim()
    }
    $run = Get-ItemProperty -Path "HKCU:\Software\Microsoft\Windows\CurrentVersion\Run" -Name "Strata" -ErrorAction SilentlyContinue
    if ($run -and $run.Strata -like "*$Prefix*") { Set-Autostart $false; Say "removed the login entry" }
    if ((Test-Path $Shortcut) -and -not $NoShortcut) { Remove-Item -Force $Shortcut }
    Remove-Item -Recurse -Force $Venv
    if (Test-Path $IconPath) { Remove-Item -Force $IconPath }
    if (-not (Get-ChildItem -Force $Prefix)) { Remove-Item -Force $Prefix }
    Say "removed Strata from $Prefix"
    if ($models -and (Test-Path $models)) {
        Remove-Item -Recurse -Force $models
        Say "deleted the model cache $models"
    } elseif (-not $PurgeModels) {
        Say "kept models, snapshots and the config file; -PurgeModels deletes the models too"
    }
}

if ($PurgeModels -and -not $Uninstall) { Fail "-PurgeModels only goes with -Uninstall" }
if ($StopOnly) { Stop-RunningStrata; exit 0 }
if ($Uninstall) { Uninstall-Strata } else { Install-Strata }
