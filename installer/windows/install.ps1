<#
.SYNOPSIS
    Install Strata for the current user without building an installer (or uninstall it).

.DESCRIPTION
    Creates a virtualenv in -Prefix (default %LOCALAPPDATA%\Programs\Strata\venv), installs
    PyTorch from PyTorch's CUDA index (PyPI's Windows PyTorch has no CUDA) and then Strata from
    a checkout or a wheel, adds a Start-menu shortcut and, with -Autostart, the same login entry
    the tray's "Start at login" switch writes (HKCU\...\Run, value "Strata").
    Models, snapshots and the config file live outside -Prefix and survive an uninstall;
    -PurgeModels deletes the model cache too.

    NOT TESTED ON WINDOWS: written on Linux, where it could not be run. See docs/getting-started.md.

.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installer\windows\install.ps1 -Autostart
.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installer\windows\install.ps1 -Uninstall -PurgeModels
#>
[CmdletBinding()]
param(
    [string]$Prefix = (Join-Path $env:LOCALAPPDATA "Programs\Strata"),
    [string]$Python = "",            # an interpreter path; default: the newest 3.11+ from `py`
    [string]$Source = $env:STRATA_SOURCE,  # a checkout or a .whl; default: this checkout
    [string]$TorchIndexUrl = "https://download.pytorch.org/whl/cu128",
    [switch]$CpuOnly,                # PyTorch from PyPI (CPU build) instead of the CUDA index
    [switch]$Autostart,
    [switch]$NoShortcut,             # the Inno Setup installer makes its own shortcut
    [switch]$Uninstall,
    [switch]$PurgeModels
)

$ErrorActionPreference = "Stop"
$Venv = Join-Path $Prefix "venv"
$VenvPython = Join-Path $Venv "Scripts\python.exe"
$VenvPythonw = Join-Path $Venv "Scripts\pythonw.exe"
$IconPath = Join-Path $Prefix "strata.ico"
$Shortcut = Join-Path ([Environment]::GetFolderPath("Programs")) "Strata.lnk"

function Fail([string]$Message) {
    Write-Host "install.ps1: error: $Message" -ForegroundColor Red
    exit 1
}

function Say([string]$Message) { Write-Host "install.ps1: $Message" }

function Invoke-Checked([string]$What, [string]$Exe, [string[]]$Arguments) {
    & $Exe @Arguments
    if ($LASTEXITCODE -ne 0) { Fail "$What failed (exit code $LASTEXITCODE); see the messages above" }
}

function Find-Python {
    $check = "import sys; sys.exit(sys.version_info < (3, 11))"
    if ($Python) {
        & $Python -c $check 2>$null
        if ($LASTEXITCODE -ne 0) { Fail "$Python is not Python 3.11 or newer; pass another with -Python" }
        return $Python
    }
    foreach ($version in "3.13", "3.12", "3.11") {
        $found = & py "-$version" -c "import sys; print(sys.executable)" 2>$null
        if ($LASTEXITCODE -eq 0 -and $found) { return $found.Trim() }
    }
    Fail "no Python 3.11+ found through the py launcher; install one from python.org or pass -Python"
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
    New-Item -ItemType Directory -Force -Path $Prefix | Out-Null
    Say "creating a virtualenv in $Venv with $interpreter"
    Invoke-Checked "creating the virtualenv" $interpreter @("-m", "venv", $Venv)
    Invoke-Checked "updating pip" $VenvPython @("-m", "pip", "install", "--upgrade", "pip")
    if (-not $CpuOnly) {
        Say "installing PyTorch with CUDA from $TorchIndexUrl (a few GB)"
        Invoke-Checked "installing PyTorch" $VenvPython @("-m", "pip", "install", "torch", "--index-url", $TorchIndexUrl)
    }
    Say "installing Strata from $src"
    Invoke-Checked "installing Strata" $VenvPython @("-m", "pip", "install", $src)

    # Windows shortcuts need an .ico; render it from the packaged SVG with Qt, which Strata ships.
    $iconCode = "import sys; from importlib.resources import files; " +
        "from PySide6.QtGui import QGuiApplication, QIcon; app = QGuiApplication(['x']); " +
        "icon = QIcon(str(files('strata.resources') / 'icons' / 'strata.svg')); " +
        "sys.exit(0 if icon.pixmap(256, 256).save(sys.argv[1], 'ICO') else 1)"
    $env:QT_QPA_PLATFORM = "offscreen"
    & $VenvPython -c $iconCode $IconPath
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
    $version = & (Join-Path $Venv "Scripts\strata.exe") --version
    Say "installed $version into $Prefix; run $Venv\Scripts\strata.exe or start Strata from the Start menu"
}

function Uninstall-Strata {
    if (-not (Test-Path $VenvPython)) { Fail "no Strata installation in $Prefix; check -Prefix" }
    $models = ""
    if ($PurgeModels) {
        $models = (& $VenvPython -c "from strata.paths import model_cache_dir; print(model_cache_dir())").Trim()
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
if ($Uninstall) { Uninstall-Strata } else { Install-Strata }
