; Inno Setup 6 script for Strata: a per-user installer that brings its own Python, with a
; Start-menu entry, an optional "start at login" task and an uninstaller. NOT RUN ON WINDOWS.
; Compiled with ISCC and run silently under wine in CI (tests/installer/test_inno_wine.py), with
; a stand-in for uv.exe (the real one does not start under wine 8) and for PowerShell (wine has
; none); see README's Windows section.
;
; Build, from the repository root on Windows (python: any Python, only for these two steps):
;   pip wheel --no-deps -w dist .
;   python installer\windows\fetch_uv.py            -> dist\uv.exe (the pinned uv, from PyPI)
;   iscc installer\windows\strata.iss                -> dist\strata-setup.exe
; Signing: docs/getting-started.md, Windows.
;
; The setup carries uv.exe, Strata's wheel, installer/constraints.txt and install.ps1. Before
; any file is installed (PrepareToInstall below) it checks the free disk space, then runs uv:
; a private CPython 3.12 into {app}\python (never the user's Python; no PATH or registry
; entry), a virtualenv in {app}\venv, PyTorch (the CUDA build from PyTorch's index where an
; NVIDIA driver answers `nvidia-smi -L`, else PyPI's CPU build) and Strata's wheel, both with
; the pins of constraints.txt. A progress page shows the step and uv's last line. A failing
; step offers Retry; Cancel stops the setup with the reason and the log's path (exit code 7
; when silent), so no shortcut can point at a virtualenv that does not exist.
;
; ISCC /DPowerShell=... replaces powershell.exe (the test's double; the test puts a stand-in
; in dist\uv.exe). Setup's /NEEDMIB=n replaces the disk space it asks for (the test's check).

#define AppName "Strata"
#define AppVersion "0.1.0"
#define Wheel "strata-" + AppVersion + "-py3-none-any.whl"
#define TorchVersion "2.13.0"
#define TorchCudaIndex "https://download.pytorch.org/whl/cu128"
; Free space asked for before downloading, MiB: PyTorch's CUDA build downloads about 3 GB and
; unpacks to about 4.5 GB next to uv's cache of it (hard links, the same drive); the CPU build
; about 0.2 GB and 1 GB; Python and Strata's other wheels about 0.6 GB.
#define NeedCudaMiB "8192"
#define NeedCpuMiB "2560"
#ifndef PowerShell
  #define PowerShell "{sys}\WindowsPowerShell\v1.0\powershell.exe"
#endif

[Setup]
AppId={{5B0C7E0A-3E7C-4B8E-9A59-7A4C2F1D6E21}
AppName={#AppName}
AppVersion={#AppVersion}
AppPublisher=Strata contributors
AppComments=Local LLM server in the tray that gives GPU memory back when other apps need it
DefaultDirName={localappdata}\Strata
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
OutputDir=..\..\dist
OutputBaseFilename=strata-setup
Compression=lzma2
SolidCompression=yes
WizardStyle=modern
UninstallDisplayName={#AppName}
UninstallDisplayIcon={app}\strata.ico
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
; {log}: the failure page names it
SetupLogging=yes
#ifdef Sign
; ISCC /Ssigntool="signtool.exe sign ... $f" /DSign=signtool (docs/getting-started.md, Windows)
SignTool={#Sign}
SignedUninstaller=yes
#endif

[Tasks]
Name: "autostart"; Description: "Start Strata when I log in"; Flags: unchecked
Name: "cpuonly"; Description: "No NVIDIA GPU: install the CPU build of PyTorch (smaller)"; Flags: unchecked

[Files]
Source: "install.ps1"; DestDir: "{app}"; Flags: ignoreversion
Source: "..\..\dist\{#Wheel}"; DestDir: "{app}"; Flags: ignoreversion
Source: "..\..\dist\uv.exe"; Flags: dontcopy
Source: "..\constraints.txt"; Flags: dontcopy
Source: "..\..\LICENSE"; DestDir: "{app}"; Flags: ignoreversion skipifsourcedoesntexist

[Icons]
; pythonw: the tray opens no console window. strata.ico is rendered after the install.
Name: "{autoprograms}\Strata"; Filename: "{app}\venv\Scripts\pythonw.exe"; Parameters: "-m strata.app.main"; WorkingDir: "{app}"; IconFilename: "{app}\strata.ico"; Comment: "Local LLM server that shares the GPU"

[Run]
Filename: "{app}\venv\Scripts\pythonw.exe"; Parameters: "-m strata.app.main"; \
  Description: "Start Strata now"; Flags: nowait postinstall skipifsilent

[Registry]
; The value the tray's "Start at login" switch writes (strata.app.autostart).
Root: HKCU; Subkey: "Software\Microsoft\Windows\CurrentVersion\Run"; ValueType: string; \
  ValueName: "Strata"; ValueData: """{app}\venv\Scripts\pythonw.exe"" -m strata.app.main"; \
  Tasks: autostart; Flags: uninsdeletevalue

[UninstallDelete]
Type: filesandordirs; Name: "{app}\python"
Type: filesandordirs; Name: "{app}\uv-cache"
Type: filesandordirs; Name: "{app}\venv"
Type: files; Name: "{app}\strata.ico"

[Code]
var
  ProgressPage: TOutputProgressWizardPage;
  CurrentStep: String;
  LastLine: String;
  ErrorLine: String;  { uv's first "error:" line: its causes and output follow it }

function SetEnvironmentVariable(Name, Value: String): BOOL;
  external 'SetEnvironmentVariableW@kernel32.dll stdcall';

function Quoted(const S: String): String;
begin
  Result := '"' + S + '"';
end;

{ Runs install.ps1 and says why it failed: PowerShell could not be started, or the script's
  own reason (it writes it to -ErrorFile before exiting with 1), or its bare exit code. }
function RunInstallScript(const Script, Arguments, What: String; var Reason: String): Boolean;
var
  ResultCode: Integer;
  ErrorFile: String;
  Message: AnsiString;
begin
  ErrorFile := ExpandConstant('{tmp}\install-error.txt');
  DeleteFile(ErrorFile);
  Log('Running ' + Script + ' ' + Arguments);
  Result := False;
  if not Exec(ExpandConstant('{#PowerShell}'),
      '-NoProfile -ExecutionPolicy Bypass -File "' + Script + '" ' + Arguments +
      ' -ErrorFile "' + ErrorFile + '"', '', SW_HIDE, ewWaitUntilTerminated, ResultCode) then
    Reason := What + ' failed: PowerShell could not be started (' + SysErrorMessage(ResultCode) + ')'
  else if ResultCode <> 0 then
  begin
    if LoadStringFromFile(ErrorFile, Message) and (Trim(String(Message)) <> '') then
      Reason := What + ' failed: ' + Trim(String(Message))
    else
      Reason := What + ' failed with exit code ' + IntToStr(ResultCode);
  end
  else
    Result := True;
  if not Result then
    Log(Reason);
end;

{ Each line uv prints goes to the setup's log and under the step's name on the progress page.
  uv prints no percentages when its output is not a console, so the bar runs as a marquee. }
procedure OnUvLine(const S: String; const Error, FirstLine: Boolean);
begin
  Log('uv: ' + S);
  if Trim(S) <> '' then
  begin
    LastLine := Trim(S);
    if (ErrorLine = '') and (Pos('error:', LastLine) = 1) then
      ErrorLine := LastLine;
    ProgressPage.SetText(CurrentStep, LastLine);
  end;
end;

{ One step: Exe with Parameters, its output shown as it comes. }
function RunStep(const Step, Exe, Parameters: String; var Reason: String): Boolean;
var
  ResultCode: Integer;
begin
  CurrentStep := Step;
  LastLine := '';
  ErrorLine := '';
  ProgressPage.SetText(Step, '');
  Log('Step "' + Step + '": ' + Exe + ' ' + Parameters);
  Result := ExecAndLogOutput(Exe, Parameters, ExpandConstant('{app}'), SW_HIDE,
    ewWaitUntilTerminated, ResultCode, @OnUvLine) and (ResultCode = 0);
  if Result then
    Exit;
  if not FileExists(Exe) then
    Reason := Step + ' failed: ' + Exe + ' could not be started (' +
      SysErrorMessage(ResultCode) + ')'
  else if ErrorLine <> '' then
    Reason := Step + ' failed (exit code ' + IntToStr(ResultCode) + '): ' + ErrorLine
  else if LastLine <> '' then
    Reason := Step + ' failed (exit code ' + IntToStr(ResultCode) + '): ' + LastLine
  else
    Reason := Step + ' failed with exit code ' + IntToStr(ResultCode);
  Log(Reason);
end;

function HasNvidiaDriver: Boolean;
var
  ResultCode: Integer;
begin
  { nvidia-smi ships with the driver (System32) and fails when no driver is loaded. }
  Result := (not WizardIsTaskSelected('cpuonly')) and
    Exec(ExpandConstant('{sys}\nvidia-smi.exe'), '-L', '', SW_HIDE, ewWaitUntilTerminated,
      ResultCode) and (ResultCode = 0);
end;

{ The free space asked for: /NEEDMIB=n, else by the PyTorch build. }
function NeededMiB(Cuda: Boolean): Int64;
begin
  if Cuda then
    Result := StrToInt64Def(ExpandConstant('{param:NEEDMIB|{#NeedCudaMiB}}'), {#NeedCudaMiB})
  else
    Result := StrToInt64Def(ExpandConstant('{param:NEEDMIB|{#NeedCpuMiB}}'), {#NeedCpuMiB});
end;

function GiB(MiB: Int64): String;
begin
  Result := Format('%.1f GiB', [MiB / 1024.0]);
end;

function CheckDiskSpace(Cuda: Boolean; var Reason: String): Boolean;
var
  Drive: String;
  FreeBytes, TotalBytes, NeedMiB: Int64;
begin
  Drive := AddBackslash(ExtractFileDrive(ExpandConstant('{app}')));
  NeedMiB := NeededMiB(Cuda);
  ProgressPage.SetText('Checking the free disk space on ' + Drive, 'Strata needs ' + GiB(NeedMiB));
  Result := not GetSpaceOnDisk64(Drive, FreeBytes, TotalBytes);  { unknown: go on }
  if Result then
    Log('Free space on ' + Drive + ' unknown')
  else
  begin
    Log(Format('Disk space on %s: %d MiB free, %d MiB needed', [Drive, FreeBytes div 1048576, NeedMiB]));
    Result := FreeBytes div 1048576 >= NeedMiB;
  end;
  if not Result then
  begin
    Reason := 'Not enough disk space on ' + Drive + ': Strata needs ' + GiB(NeedMiB) + ' ';
    if Cuda then
      Reason := Reason + '(PyTorch with CUDA downloads about 3 GB and unpacks to about 4.5 GB)'
    else
      Reason := Reason + '(Python and PyTorch''s CPU build)';
    Reason := Reason + ', ' + GiB(FreeBytes div 1048576) + ' is free. Free some space and retry';
    Log(Reason);
  end;
end;

{ Stops a running Strata of this installation (an upgrade: it holds the venv's files open). }
function StopRunningStrata(var Reason: String): Boolean;
begin
  Result := True;
  if FileExists(ExpandConstant('{app}\venv\Scripts\python.exe')) then
  begin
    ProgressPage.SetText('Stopping the running Strata', '');
    ExtractTemporaryFile('install.ps1');
    Result := RunInstallScript(ExpandConstant('{tmp}\install.ps1'),
      '-StopOnly -Prefix ' + Quoted(ExpandConstant('{app}')), 'Stopping the running Strata', Reason);
  end;
end;

{ Python, the virtualenv and the wheels, with uv; '' when done, else the reason. }
function InstallRuntime: String;
var
  Uv, App, Venv, Python, Constraints, Common, Torch: String;
  Cuda: Boolean;
begin
  Result := '';
  App := ExpandConstant('{app}');
  Venv := App + '\venv';
  Python := Venv + '\Scripts\python.exe';
  Uv := ExpandConstant('{tmp}\uv.exe');
  Constraints := ExpandConstant('{tmp}\constraints.txt');
  { --no-config: a uv.toml of the user's changes nothing here. }
  Common := ' --no-config';
  Cuda := HasNvidiaDriver;
  { SetProgress shows the bar, which runs as a marquee (PrepareToInstall) and so ignores it. }
  ProgressPage.SetProgress(0, 1);
  if not CheckDiskSpace(Cuda, Result) then
    Exit;
  if not StopRunningStrata(Result) then
    Exit;
  ForceDirectories(App);
  { uv's own settings (UV_DEFAULT_INDEX, UV_PYTHON_INSTALL_MIRROR, proxies) pass through. }
  SetEnvironmentVariable('UV_PYTHON_INSTALL_DIR', App + '\python');
  SetEnvironmentVariable('UV_CACHE_DIR', App + '\uv-cache');
  { --no-bin, --no-registry: no python.exe on the user's PATH, no PEP 514 registry entry. }
  if not RunStep('Step 1 of 4: downloading Python 3.12 (private to Strata, about 30 MB)', Uv,
      'python install 3.12 --no-bin --no-registry' + Common, Result) then
    Exit;
  if not RunStep('Step 2 of 4: creating Strata''s environment', Uv,
      'venv --managed-python --python 3.12 --allow-existing' + Common + ' ' + Quoted(Venv), Result) then
    Exit;
  Torch := 'pip install --python ' + Quoted(Python) + ' --constraints ' + Quoted(Constraints) +
    Common + ' torch=={#TorchVersion}';
  if Cuda then
  begin
    { PyPI's PyTorch for Windows is a CPU build: the CUDA one comes from PyTorch's index. }
    if not RunStep('Step 3 of 4: downloading PyTorch {#TorchVersion} with CUDA (about 3 GB)', Uv,
        Torch + ' --index-url {#TorchCudaIndex}', Result) then
      Exit;
  end
  else if not RunStep('Step 3 of 4: downloading PyTorch {#TorchVersion}, CPU build (about 200 MB)',
      Uv, Torch, Result) then
    Exit;
  { --reinstall-package: the same version again (a rebuilt wheel) is installed too. }
  if not RunStep('Step 4 of 4: installing Strata and its libraries', Uv,
      'pip install --python ' + Quoted(Python) + ' --constraints ' + Quoted(Constraints) + Common +
      ' --reinstall-package strata ' + Quoted(ExpandConstant('{tmp}\{#Wheel}')), Result) then
    Exit;
  if not RunStep('Checking the installation', Venv + '\Scripts\strata.exe', '--version', Result) then
    Exit;
end;

{ Windows shortcuts need an .ico: rendered from the packaged SVG with Qt, which Strata ships.
  Without it the shortcut shows Python's icon, so a failure is only logged. }
procedure RenderIcon;
var
  ResultCode: Integer;
begin
  SetEnvironmentVariable('QT_QPA_PLATFORM', 'offscreen');
  if not Exec(ExpandConstant('{app}\venv\Scripts\python.exe'), '-c "import sys; ' +
      'from importlib.resources import files; from PySide6.QtGui import QGuiApplication, QIcon; ' +
      'app = QGuiApplication([''x'']); ' +
      'icon = QIcon(str(files(''strata.resources'') / ''icons'' / ''strata.svg'')); ' +
      'sys.exit(0 if icon.pixmap(256, 256).save(sys.argv[1], ''ICO'') else 1)" ' +
      Quoted(ExpandConstant('{app}\strata.ico')), '', SW_HIDE, ewWaitUntilTerminated,
      ResultCode) or (ResultCode <> 0) then
    Log('Could not render strata.ico; the shortcut gets Python''s icon');
end;

procedure InitializeWizard;
begin
  ProgressPage := CreateOutputProgressPage('Installing Strata',
    'Setup downloads a private Python and PyTorch; this takes a few minutes.');
end;

{ Everything uv installs happens here, before Inno installs any file. A failed step offers
  Retry; Cancel (and a silent setup) stops the setup with the reason: a non-empty result,
  shown on the "Preparing to Install" page, exit code 7. }
function PrepareToInstall(var NeedsRestart: Boolean): String;
begin
  ExtractTemporaryFile('uv.exe');
  ExtractTemporaryFile('constraints.txt');
  ExtractTemporaryFile('{#Wheel}');
  ProgressPage.Show;
  try
    repeat
      ProgressPage.ProgressBar.Style := npbstMarquee;
      Result := InstallRuntime;
      ProgressPage.ProgressBar.Style := npbstNormal;
    until (Result = '') or (SuppressibleMsgBox(Result + '.' + #13#10#13#10 + 'Details: ' +
      ExpandConstant('{log}'), mbError, MB_RETRYCANCEL, IDCANCEL) <> IDRETRY);
  finally
    ProgressPage.Hide;
  end;
  if Result <> '' then
    Result := Result + '. Details are in the setup log: ' + ExpandConstant('{log}')
  else
    RenderIcon;
end;

{ Uninstall: install.ps1 stops a running tray, removes the login entry and the virtualenv;
  Inno then removes the files it installed, the private Python and uv's cache. A failure is
  reported, not hidden. }
procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
var
  Reason: String;
begin
  if CurUninstallStep = usUninstall then
    if not RunInstallScript(ExpandConstant('{app}\install.ps1'),
        '-Uninstall -NoShortcut -Prefix "' + ExpandConstant('{app}') + '"',
        'Removing Strata''s virtualenv', Reason) then
      SuppressibleMsgBox(Reason + '. Close Strata and delete ' + ExpandConstant('{app}') +
        ' by hand.', mbError, MB_OK, IDOK);
end;
